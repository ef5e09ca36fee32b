"""torch's own DDP and fully_shard on the "mpidist" backend against the same on gloo and
against no communication at all; its collectives against gloo and raw MPI.

Usage::

    mpiexec -n 2 python benchmarks/torch_backend.py [--model transformer|mlp|both]
    mpiexec -n 4 python benchmarks/torch_backend.py --steps 10 --rounds 3

Training: the models of ``torch_models.py`` (a GPT of 0.83 M parameters, compute-bound; an
MLP of 3.48 M, gradient-bound), float32, Adam, one thread a rank, trained the same steps
eight ways in alternating rounds (each keeps its best median step over the rounds):
``floor`` (the plain module on the rank's local batch, no communication), ``solo-fsdp``
(``fully_shard`` over a group of the rank alone: FSDP2's own work on DTensor parameters, the
same local batch, no communication: fully_shard's floor), torch's
``DistributedDataParallel`` and ``fully_shard`` on a gloo group, the same two on the
"mpidist" default group, and both again on an "mpidist" group whose asynchronous calls run on
a communication thread (``MPIDIST_TORCH_OVERLAP=1``). The step time is the slowest rank's.

Collectives: ``dist.all_reduce``, ``dist.all_gather_into_tensor`` and
``dist.reduce_scatter_tensor`` on the mpidist group, on the gloo group, and as one raw mpi4py
call on the same buffer, alternating call by call behind a barrier (median of ``--repeats``
of the slowest rank's time); the 4 KB and the model-sized (13 MB for the MLP) all_reduce are
the goals' figures. The per-call cost of the backend is also timed without barriers (3000
back-to-back 4 KB all_reduces against as many raw ``MPI_Allreduce``).

Goals (2 ranks): DDP step <= 0.85x gloo's on both models and <= 1.05x the floor on the
transformer; fully_shard <= 0.6x gloo's; the 13 MB all_reduce <= 1.05x raw MPI; the 4 KB
all_reduce <= 0.08x gloo's. A JSON file with every figure goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("transformer", "mlp", "both", "none"), default="both")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all variants")
    p.add_argument("--repeats", type=int, default=30, help="timed calls per collective")
    p.add_argument("--sizes", default="4096,65536,1048576,13942784",
                   help="collective sizes in bytes, comma-separated")
    p.add_argument("--out", default="runs/bench")
    return p.parse_args()


ARGS = parse_args()
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch_models as TM  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpidist.torch  # noqa: E402,F401 - registers the backend

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
KINDS = ("floor", "gloo-ddp", "mpidist-ddp", "overlap-ddp", "solo-fsdp", "gloo-fsdp",
         "mpidist-fsdp", "overlap-fsdp")


def say(*a: object) -> None:
    if RANK == 0:
        print(*a, flush=True)


def make_groups() -> dict[str, dist.ProcessGroup | None]:
    """The default "mpidist" group (blocking), one with the communication thread, gloo's, and
    each rank alone ("solo": fully_shard's own work without communication)."""
    os.environ["MPIDIST_TORCH_OVERLAP"] = "0"
    dist.init_process_group("mpidist")
    os.environ["MPIDIST_TORCH_OVERLAP"] = "1"
    overlap = dist.new_group(backend="mpidist")
    os.environ["MPIDIST_TORCH_OVERLAP"] = "0"
    solo, _ = dist.new_subgroups(group_size=1)
    return {"mpidist": None, "overlap": overlap, "gloo": dist.new_group(backend="gloo"),
            "solo": solo}


def build(kind: str, name: str, groups: dict) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = TM.make_model(name)
    if kind != "floor":
        backend, how = kind.split("-")
        group = groups[backend]
        if how == "ddp":
            model = DDP(model, process_group=group)
        else:
            mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def run(kind: str, name: str, gb: int, steps: int, groups: dict) -> dict:
    net, opt = build(kind, name, groups)
    times, losses = TM.timed_steps(net, opt, name, gb, steps, COMM)
    return {"step_s": statistics.median(times), "losses": losses}


def bench_model(name: str, groups: dict) -> dict:
    gb = 16 if name == "transformer" else 64
    n_params = sum(p.numel() for p in TM.make_model(name).parameters())
    say(f"\n== {name}: {n_params / 1e6:.2f} M parameters, global batch {gb}, {SIZE} ranks, "
        f"{ARGS.steps} timed steps x {ARGS.rounds} rounds")
    results: dict[str, dict] = {}
    for _ in range(ARGS.rounds):
        for kind in KINDS:
            r = run(kind, name, gb, ARGS.steps, groups)
            if kind in results:
                r["step_s"] = min(r["step_s"], results[kind]["step_s"])
            results[kind] = r
    floor = results["floor"]["step_s"]
    ref = results["gloo-ddp"]["losses"]
    say(f"{'variant':<14} {'step ms':>9} {'/ gloo':>8} {'/ floor':>8} {'max |dloss|':>12}")
    for kind, r in results.items():
        solo = kind in ("floor", "solo-fsdp")
        peer = results.get("gloo-" + kind.split("-")[-1]) if not solo else None
        ratio = r["step_s"] / peer["step_s"] if peer and peer is not r else float("nan")
        r["vs_gloo"], r["vs_floor"] = ratio, r["step_s"] / floor
        diff = max(abs(a - b) for a, b in zip(r["losses"], ref, strict=True))
        say(f"{kind:<14} {r['step_s'] * 1e3:9.2f} {ratio:8.2f} {r['step_s'] / floor:8.2f} "
            f"{diff:12.2e}")
    return {"params": n_params, "global_batch": gb, "results": results}


def collective(op: str, nbytes: int, groups: dict) -> dict[str, float]:
    numel = max(nbytes // 4 // SIZE * SIZE, SIZE)
    send = torch.ones(numel if op != "all_gather" else numel // SIZE)
    recv = torch.empty(numel if op == "all_gather" else numel // SIZE)
    a, b = send.numpy(), recv.numpy()

    def on(group):
        if op == "all_reduce":
            return lambda: dist.all_reduce(send, group=group)
        if op == "all_gather":
            return lambda: dist.all_gather_into_tensor(recv, send, group=group)
        return lambda: dist.reduce_scatter_tensor(recv, send, group=group)

    raw = {"all_reduce": lambda: COMM.Allreduce(MPI.IN_PLACE, a),
           "all_gather": lambda: COMM.Allgather(a, b),
           "reduce_scatter": lambda: COMM.Reduce_scatter_block(a, b)}[op]
    variants = {"mpidist": on(None), "gloo": on(groups["gloo"]), "mpi": raw}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(ARGS.repeats + 3):
        for k, fn in variants.items():
            COMM.Barrier()
            t0 = time.perf_counter()
            fn()
            dt = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i >= 3:
                times[k].append(dt)
            send.fill_(1.0)
    return {k: statistics.median(v) for k, v in times.items()}


def per_call(calls: int = 3000) -> dict[str, float]:
    """Seconds per 4 KB all_reduce, back to back: the backend and raw MPI."""
    t = torch.ones(1024)
    a = t.numpy()
    out = {}
    for name, fn in (("mpidist", lambda: dist.all_reduce(t)),
                     ("mpi", lambda: COMM.Allreduce(MPI.IN_PLACE, a))):
        for _ in range(200):
            fn()
        COMM.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = COMM.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX)
    return out


def bench_collectives(groups: dict) -> dict:
    say(f"\n== collectives on {SIZE} ranks: median of {ARGS.repeats} calls (slowest rank)")
    say(f"{'op':15s} {'bytes':>9s} {'mpidist':>10s} {'gloo':>10s} {'raw MPI':>10s} "
        f"{'mpidist/gloo':>13s} {'mpidist/MPI':>12s}")
    rows = []
    for nbytes in (int(s) for s in ARGS.sizes.split(",")):
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            t = collective(op, nbytes, groups)
            rows.append({"op": op, "bytes": nbytes, **t})
            say(f"{op:15s} {nbytes:9d} {t['mpidist'] * 1e6:8.1f}us {t['gloo'] * 1e6:8.1f}us "
                f"{t['mpi'] * 1e6:8.1f}us {t['mpidist'] / t['gloo']:12.3f}x "
                f"{t['mpidist'] / t['mpi']:11.2f}x")
    calls = per_call()
    say(f"4 KB all_reduce back to back: {calls['mpidist'] * 1e6:.1f} us a call on the backend, "
        f"{calls['mpi'] * 1e6:.1f} us raw MPI_Allreduce (the backend adds "
        f"{(calls['mpidist'] - calls['mpi']) * 1e6:.1f} us: torch's dispatch and its Python)")
    return {"rows": rows, "per_call": calls}


def main() -> None:
    torch.set_num_threads(1)
    groups = make_groups()
    say(f"torch_backend: torch {torch.__version__}, {SIZE} ranks, "
        f"{MPI.Get_library_version().splitlines()[0][:40]}")
    names = {"both": ("transformer", "mlp"), "none": ()}.get(ARGS.model, (ARGS.model,))
    out: dict = {"ranks": SIZE, "args": vars(ARGS)}
    out["models"] = {name: bench_model(name, groups) for name in names}
    out["collectives"] = bench_collectives(groups)
    if RANK == 0:
        os.makedirs(ARGS.out, exist_ok=True)
        path = os.path.join(ARGS.out, f"torch_backend_np{SIZE}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(f"\nwrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
