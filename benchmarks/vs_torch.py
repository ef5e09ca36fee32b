"""Head to head with torch.distributed on the same torch model, in one run.

Usage::

    mpiexec -n 2 python benchmarks/vs_torch.py [--steps 10] [--width 1024] [--out DIR]
    mpiexec -n 4 python benchmarks/vs_torch.py

The same torch MLP (a few M parameters, float32, same initial weights, same data, Adam) is
trained for the same steps six ways: torch DDP, torch ZeroRedundancyOptimizer and torch FSDP
(SHARD_GRAD_OP, i.e. ZeRO-2; all on the gloo backend, initialised from the MPI rank and size
with a tcp://127.0.0.1 init method), and mpidist DDP, ZeRO-1 and ZeRO-2 through
``mpidist.adapters.torch``. Pairs: DDP/DDP, ZeroRedundancyOptimizer/ZeRO-1, FSDP/ZeRO-2.

Printed per configuration: median step time (max over ranks), gradient-sync time, per-rank
bytes of parameters + gradients + optimizer state, and the losses' largest difference from
torch DDP. Gradient-sync time is measured the same way for both libraries, after the
training runs: the median time of the collective that synchronises the gradients (allreduce
for DDP/ZeRO-1, reduce-scatter for ZeRO-2/FSDP) on a buffer of the model's gradient bytes,
gloo for torch, MPI for mpidist, the two libraries' calls alternating (after one warm-up
call each); mpidist's in-step communication timer (``optimizer.timers``) is printed too. Ratios are
mpidist / torch (goal: step <= 1.0x, sync <= 0.5x). A PNG bar chart is written when
matplotlib is installed, and a JSON file with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up)")
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--depth", type=int, default=4, help="hidden layers")
    p.add_argument("--d-in", type=int, default=256)
    p.add_argument("--classes", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="rounds over all configurations")
    p.add_argument("--repeats", type=int, default=30,
                   help="timed collectives per library for the sync time")
    p.add_argument("--threads", type=int, default=1, help="torch/BLAS threads per rank")
    p.add_argument("--out", default="runs/bench", help="directory for the PNG and JSON")
    return p.parse_args(argv)


ARGS = parse_args()
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[_var] = str(ARGS.threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpidist import collectives as C  # noqa: E402
from mpidist.adapters.torch import wrap_torch  # noqa: E402
from mpidist.optim import Adam  # noqa: E402
from mpidist.parallel import ShardingConfiguration  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
LR = 1e-3


def say(*a: object) -> None:
    if RANK == 0:
        print(*a, flush=True)


def make_model(args: argparse.Namespace) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(args.d_in, args.width), torch.nn.GELU()]
    for _ in range(args.depth - 1):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(args.width, args.classes))
    return torch.nn.Sequential(*layers)


def local_batch(args: argparse.Namespace, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((args.global_batch, args.d_in), dtype=np.float32)
    y = rng.integers(0, args.classes, size=args.global_batch)
    b = args.global_batch // SIZE
    return x[RANK * b:(RANK + 1) * b], y[RANK * b:(RANK + 1) * b]


def max_over_ranks(v: float) -> float:
    return float(COMM.allreduce(v, op=MPI.MAX))


def torch_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state tensors."""
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's optimizer
    for st in inner.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                total += v.numel() * v.element_size()
    return total


# -- torch ------------------------------------------------------------------------------
def run_torch(kind: str, args: argparse.Namespace) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(args)
    if kind == "torch-ddp":
        net = DDP(model)
        opt = torch.optim.Adam(net.parameters(), lr=LR)
    elif kind == "torch-zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        net = DDP(model)
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        net = FSDP(model, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
                   device_id=torch.device("cpu"))
        opt = torch.optim.Adam(net.parameters(), lr=LR)
    losses: list[float] = []

    def step(s: int) -> None:
        x, y = local_batch(args, s)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        glob = loss.detach().clone() / SIZE
        dist.all_reduce(glob)
        losses.append(float(glob))

    times = train(step, args)
    mem = torch_bytes(net, opt)
    return {"step_s": statistics.median(times), "memory_bytes": mem, "losses": losses}


# -- mpidist ------------------------------------------------------------------------------
def run_mpidist(strategy: str, args: argparse.Namespace) -> dict:
    model = make_model(args)
    config = ShardingConfiguration(dtype="float32")
    trainer = wrap_torch(model, strategy, Adam(lr=LR), config, units="children")
    losses: list[float] = []

    def step(s: int) -> None:
        losses.append(trainer.step(local_batch(args, s)))

    times = train(step, args, trainer)
    mem = trainer.memory_report()["total"]
    in_step = trainer.timers["communication"] / (args.steps + 2)
    trainer.free()
    return {"step_s": statistics.median(times), "in_step_comm_s": in_step,
            "memory_bytes": int(mem), "losses": losses}


def measure_sync(n_grad: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds of the gradient-synchronising collective of ``n_grad`` float32 (the
    model's gradient bytes, rounded up to a multiple of the ranks), gloo and MPI calls
    alternating so that both see the same machine: ``{kind: {"torch": s, "mpidist": s}}``
    for kind allreduce and reduce-scatter."""
    n = -(-n_grad // SIZE) * SIZE
    flat_t, out_t = torch.zeros(n, dtype=torch.float32), torch.zeros(n // SIZE)
    flat_m, out_m = np.zeros(n, dtype=np.float32), np.zeros(n // SIZE, dtype=np.float32)
    calls = {
        "allreduce": {"torch": lambda: dist.all_reduce(flat_t),
                      "mpidist": lambda: C.allreduce(flat_m, "sum", comm=COMM)},
        "reduce-scatter": {"torch": lambda: dist.reduce_scatter_tensor(out_t, flat_t),
                           "mpidist": lambda: C.reduce_scatter(flat_m, "sum", comm=COMM,
                                                               out=out_m)},
    }
    result: dict[str, dict[str, float]] = {}
    for kind, fns in calls.items():
        times: dict[str, list[float]] = {lib: [] for lib in fns}
        for fn in fns.values():
            fn()  # warm-up: first-touch of the buffers, connection setup
        for _ in range(repeats):
            for lib, fn in fns.items():
                COMM.Barrier()
                t0 = time.perf_counter()
                fn()
                times[lib].append(max_over_ranks(time.perf_counter() - t0))
        result[kind] = {lib: statistics.median(v) for lib, v in times.items()}
    return result


def train(step, args: argparse.Namespace, trainer=None) -> list[float]:
    for s in range(2):
        step(s)
    if trainer is not None:
        for k in trainer.timers:
            trainer.timers[k] = 0.0
    times = []
    for s in range(2, 2 + args.steps):
        COMM.Barrier()
        t0 = time.perf_counter()
        step(s)
        times.append(max_over_ranks(time.perf_counter() - t0))
    if trainer is not None:  # per step over the timed steps only
        trainer.timers["communication"] *= (args.steps + 2) / args.steps
    return times


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


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    if args.global_batch % SIZE:
        raise ValueError(f"--global-batch={args.global_batch} must divide by {SIZE} ranks")
    init_torch_distributed()
    n_params = sum(p.numel() for p in make_model(args).parameters())
    say(f"vs_torch: {SIZE} ranks, MLP {args.d_in}-{args.width}x{args.depth}-{args.classes} "
        f"({n_params / 1e6:.2f} M params, float32), global batch {args.global_batch}, "
        f"{args.steps} timed steps, {args.threads} thread(s)/rank, torch {torch.__version__}")
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}
    # Rounds alternate the libraries so that load from other processes on a shared machine
    # hits both alike; each configuration keeps its best (lowest) step and sync times.
    for _ in range(args.rounds):
        for kind in ("torch-ddp", "mpidist-ddp", "torch-zero", "mpidist-zero1", "torch-fsdp",
                     "mpidist-zero2"):
            if kind in errors:
                continue
            try:
                if kind.startswith("torch"):
                    r = run_torch(kind, args)
                else:
                    r = run_mpidist(kind.split("-")[1], args)
            except Exception as exc:  # report honestly and go on (e.g. FSDP on CPU/gloo)
                errors[kind] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                if RANK == 0:
                    traceback.print_exc(limit=3)
                continue
            if kind in results:
                for key in ("step_s", "in_step_comm_s"):
                    if key in r:
                        r[key] = min(r[key], results[kind][key])
            results[kind] = r
            COMM.Barrier()
    syncs = measure_sync(n_params, args.repeats)
    for k, r in results.items():
        r["sync_kind"] = "reduce-scatter" if k in ("torch-fsdp", "mpidist-zero2") \
            else "allreduce"
        r["sync_s"] = syncs[r["sync_kind"]][k.split("-")[0]]
    ref = results.get("torch-ddp", {}).get("losses")
    for r in results.values():
        r["max_loss_diff"] = float(np.max(np.abs(np.subtract(r["losses"], ref)))) \
            if ref is not None else float("nan")
    mems = {k: COMM.gather(v["memory_bytes"], root=0) for k, v in results.items()}
    if RANK != 0:
        dist.destroy_process_group()
        return 0
    print(f"\n{'configuration':<15} {'step ms':>9} {'sync ms':>9} {'(kind)':<15} "
          f"{'in-step comm ms':>15} {'MB/rank':>9} {'max |dloss|':>12}")
    for k, r in results.items():
        comm_ms = f"{r['in_step_comm_s'] * 1e3:15.2f}" if "in_step_comm_s" in r else " " * 15
        print(f"{k:<15} {r['step_s'] * 1e3:9.2f} {r['sync_s'] * 1e3:9.2f} "
              f"{'(' + r['sync_kind'] + ')':<15} {comm_ms} "
              f"{max(mems[k]) / 2**20:9.2f} {r['max_loss_diff']:12.2e}")
    for k, e in errors.items():
        print(f"{k:<15} FAILED: {e}")
    pairs = [("ddp", "torch-ddp", "mpidist-ddp"), ("zero1", "torch-zero", "mpidist-zero1"),
             ("zero2", "torch-fsdp", "mpidist-zero2")]
    print(f"\n{'pair (mpidist/torch)':<32} {'step ratio':>10} {'sync ratio':>10} "
          f"{'memory ratio':>12}  goals: step <= 1.0, sync <= 0.5")
    summary = []
    for name, t, m in pairs:
        if t in results and m in results:
            sr = results[m]["step_s"] / results[t]["step_s"]
            cr = results[m]["sync_s"] / results[t]["sync_s"]
            mr = max(mems[m]) / max(mems[t])
            ok = "met" if sr <= 1.0 and cr <= 0.5 else "NOT met"
            print(f"{m + ' / ' + t:<32} {sr:10.2f} {cr:10.2f} {mr:12.2f}  {ok}")
            summary.append({"pair": name, "step_ratio": sr, "sync_ratio": cr,
                            "memory_ratio": mr})
        else:
            print(f"{m + ' / ' + t:<32} {'n/a':>10} {'n/a':>10}  (a run failed)")
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"vs_torch_np{SIZE}")
    with open(base + ".json", "w") as f:
        json.dump({"ranks": SIZE, "params": n_params, "args": vars(args),
                   "results": {k: {**v, "memory_bytes_per_rank": mems[k]}
                               for k, v in results.items()},
                   "errors": errors, "pairs": summary}, f, indent=1)
    plot(results, base + ".png", n_params)
    print(f"\nwrote {base}.json" + (f" and {base}.png" if os.path.exists(base + ".png") else ""))
    dist.destroy_process_group()
    return 0


def plot(results: dict, path: str, n_params: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    colours = ["tab:orange" if n.startswith("torch") else "tab:blue" for n in names]
    for ax, key, label, scale in ((axes[0], "step_s", "step time (ms)", 1e3),
                                  (axes[1], "sync_s", "gradient-sync time (ms)", 1e3),
                                  (axes[2], "memory_bytes", "MB per rank (rank 0)", 2**-20)):
        ax.bar(range(len(names)), [results[n][key] * scale for n in names], color=colours)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_title(label)
    fig.suptitle(f"mpidist vs torch.distributed (gloo), {SIZE} ranks, "
                 f"{n_params / 1e6:.1f} M params")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    from mpidist.launch import abort_on_failure

    with abort_on_failure():
        sys.exit(main(ARGS))
