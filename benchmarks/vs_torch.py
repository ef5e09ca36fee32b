"""mpidist.torch against torch.distributed (gloo) and against no communication at all.

Usage::

    mpiexec -n 2 python benchmarks/vs_torch.py [--model transformer|mlp|both] [--steps 10]
    mpiexec -n 4 python benchmarks/vs_torch.py --model mlp

The same torch model (same initial weights, same data, float32, Adam) is trained for the
same steps seven ways, the variants alternating in rounds so that load from other processes
hits all alike (each keeps its best median over the rounds):

* ``floor``: the plain module on this rank's local batch, no communication (what a
  data-parallel step costs when communication is completely hidden behind backward);
* ``torch-ddp`` / ``mpidist-ddp``: ``DistributedDataParallel``;
* ``torch-zero`` / ``mpidist-zero``: ``ZeroRedundancyOptimizer`` over DDP;
* ``torch-fsdp`` / ``mpidist-fsdp``: ``fully_shard`` on every block, then on the root.

torch runs on the gloo backend (tcp://127.0.0.1), mpidist on MPI. Models: a small GPT
(~0.9 M parameters, compute dominates) and the MLP (3.4 M parameters, gradients dominate).
Printed per model: step time (max over ranks), its ratio to torch's counterpart and to the
floor, the largest loss difference from the floor-free torch DDP run, and for fully_shard the
per-rank bytes of parameters + gradients + optimizer state against 1/N of the total and the
peak bytes of gathered parameters against the root unit plus two blocks. The
gradient-synchronisation time is the median of the allreduce of the model's gradient bytes,
gloo and MPI calls alternating. Goals: step <= 1.0x torch, <= 1.05x the floor on the GPT,
<= 0.6x torch on the MLP, sync <= 0.5x. A JSON file with every figure goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("transformer", "mlp", "both"), default="both")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all variants")
    p.add_argument("--repeats", type=int, default=30, help="timed collectives for the sync")
    p.add_argument("--threads", type=int, default=1, help="torch/BLAS threads per rank")
    p.add_argument("--global-batch", type=int, default=0,
                   help="global batch (default: 16 sequences or 64 MLP samples)")
    p.add_argument("--out", default="runs/bench", help="directory for the JSON file")
    return p.parse_args(argv)


ARGS = parse_args()
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[_var] = str(ARGS.threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_models as TM  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch_models import make_model  # noqa: E402

import mpidist.torch as mt  # noqa: E402
from mpidist.core import collectives as C  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
LR = 1e-3


def say(*a: object) -> None:
    if RANK == 0:
        print(*a, flush=True)


def local_batch(name: str, gb: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return TM.local_batch(name, gb, step, RANK, SIZE)


def build(kind: str, name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    model = make_model(name)
    if kind == "floor":
        return model, torch.optim.Adam(model.parameters(), lr=LR)
    if kind in ("torch-ddp", "torch-zero"):
        net = TorchDDP(model)
    elif kind in ("mpidist-ddp", "mpidist-zero"):
        net = mt.DistributedDataParallel(model, comm=COMM)
    elif kind == "torch-fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (SIZE,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        net = fully_shard(model, mesh=mesh)
    else:
        for b in model.blocks:
            mt.fully_shard(b, comm=COMM)
        net = mt.fully_shard(model, comm=COMM)
    if kind == "torch-zero":
        return net, TorchZeRO(net.parameters(), torch.optim.Adam, lr=LR)
    if kind == "mpidist-zero":
        return net, mt.ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, comm=COMM,
                                               lr=LR)
    return net, torch.optim.Adam(net.parameters(), lr=LR)


def state_bytes(net: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """This rank's bytes of parameters, gradients and optimizer-state tensors."""
    total = 0
    for p in net.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            total += g.numel() * g.element_size()
    inner = getattr(opt, "optim", opt)
    for st in inner.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                v = v.to_local() if hasattr(v, "to_local") else v
                total += v.numel() * v.element_size()
    return total


def run(kind: str, name: str, gb: int, steps: int) -> dict:
    net, opt = build(kind, name)
    times, losses = TM.timed_steps(net, opt, name, gb, steps, COMM)
    r = {"step_s": statistics.median(times), "losses": losses,
         "state_bytes": state_bytes(net, opt)}
    if kind == "mpidist-fsdp":
        x, y = local_batch(name, gb, 0)
        mt.gathered_bytes(net)  # resets the peak
        out = net(x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        stats = mt.gathered_bytes(net)
        block = max(b._mpidist_unit.full_numel for b in net.blocks) * 4
        r.update(peak_gathered=stats["peak"], root_unit=stats["root_unit"], block_unit=block)
    return r


def measure_sync(n_grad: int, repeats: int) -> dict[str, float]:
    """Median seconds of an allreduce of ``n_grad`` float32, gloo and MPI alternating."""
    flat_t = torch.zeros(n_grad, dtype=torch.float32)
    flat_m = np.zeros(n_grad, dtype=np.float32)
    fns = {"torch": lambda: dist.all_reduce(flat_t),
           "mpidist": lambda: C.allreduce(flat_m, "sum", comm=COMM)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            COMM.Barrier()
            t0 = time.perf_counter()
            fn()
            times[k].append(float(COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)))
    return {k: statistics.median(v) for k, v in times.items()}


def init_torch_distributed() -> None:
    import socket

    port = 0
    if RANK == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = COMM.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=RANK,
                            world_size=SIZE)


KINDS = ("floor", "torch-ddp", "mpidist-ddp", "torch-zero", "mpidist-zero", "torch-fsdp",
         "mpidist-fsdp")


def bench_model(name: str, args: argparse.Namespace) -> dict:
    gb = args.global_batch or (16 if name == "transformer" else 64)
    if gb % SIZE:
        raise ValueError(f"--global-batch={gb} must divide by {SIZE} ranks")
    n_params = sum(p.numel() for p in make_model(name).parameters())
    say(f"\n== {name}: {n_params / 1e6:.2f} M parameters, global batch {gb}, {SIZE} ranks, "
        f"{args.steps} timed steps x {args.rounds} rounds, {args.threads} thread(s)/rank")
    results: dict[str, dict] = {}
    for _ in range(args.rounds):
        for kind in KINDS:
            r = run(kind, name, gb, args.steps)
            if kind in results:
                r["step_s"] = min(r["step_s"], results[kind]["step_s"])
            results[kind] = r
    sync = measure_sync(n_params, args.repeats)
    ref = results["torch-ddp"]["losses"]
    for r in results.values():
        r["max_loss_diff"] = float(np.max(np.abs(np.subtract(r["losses"], ref))))
    floor = results["floor"]["step_s"]
    say(f"{'variant':<14} {'step ms':>9} {'/ torch':>8} {'/ floor':>8} {'MB/rank':>8} "
        f"{'max |dloss| vs torch-ddp':>25}")
    rows = {}
    for kind, r in results.items():
        peer = "torch-" + kind.split("-")[1] if kind.startswith("mpidist") else None
        ratio = r["step_s"] / results[peer]["step_s"] if peer else float("nan")
        rows[kind] = ratio
        say(f"{kind:<14} {r['step_s'] * 1e3:9.2f} {ratio:8.2f} {r['step_s'] / floor:8.2f} "
            f"{r['state_bytes'] / 2**20:8.2f} {r['max_loss_diff'] if kind != 'floor' else 0:25.2e}")
    fs = results["mpidist-fsdp"]
    total_bytes = results["floor"]["state_bytes"]
    blocks = (fs["peak_gathered"] - fs["root_unit"]) / max(fs["block_unit"], 1)
    say(f"fully_shard state per rank {fs['state_bytes'] / 2**20:.2f} MB = "
        f"{fs['state_bytes'] / (total_bytes / SIZE):.3f} x 1/N of {total_bytes / 2**20:.2f} MB;"
        f" peak gathered {fs['peak_gathered'] / 2**20:.2f} MB = root unit "
        f"{fs['root_unit'] / 2**20:.2f} + {blocks:.2f} x the largest block "
        f"({fs['block_unit'] / 2**20:.2f} MB)")
    say(f"gradient sync ({n_params * 4 / 2**20:.1f} MB allreduce): MPI "
        f"{sync['mpidist'] * 1e3:.2f} ms, gloo {sync['torch'] * 1e3:.2f} ms, ratio "
        f"{sync['mpidist'] / sync['torch']:.2f}")
    worst = max(rows[k] for k in rows if k.startswith("mpidist"))
    ddp_floor = results["mpidist-ddp"]["step_s"] / floor
    say(f"{name}: worst step ratio mpidist/torch {worst:.2f}, mpidist-ddp/floor "
        f"{ddp_floor:.2f}, torch-ddp/floor {results['torch-ddp']['step_s'] / floor:.2f}, "
        f"sync ratio {sync['mpidist'] / sync['torch']:.2f}")
    return {"params": n_params, "global_batch": gb, "results": results, "sync": sync,
            "ratios": rows, "ddp_over_floor": ddp_floor}


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    init_torch_distributed()
    say(f"vs_torch: torch {torch.__version__}, gloo vs MPI ({MPI.Get_library_version()[:30]})")
    names = ("transformer", "mlp") if args.model == "both" else (args.model,)
    out = {name: bench_model(name, args) for name in names}
    if RANK == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"vs_torch_np{SIZE}.json")
        with open(path, "w") as f:
            json.dump({"ranks": SIZE, "args": vars(args), "models": out}, f, indent=1)
        print(f"\nwrote {path}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from mpidist.run.launch import abort_on_failure

    with abort_on_failure():
        sys.exit(main(ARGS))
