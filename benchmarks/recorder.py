"""The flight recorder's cost: ns per MPI call with it, against the traced wrapper alone and
raw mpi4py, and the MPI calls per training step of the GPT 4x128 (TrainConfig's defaults).

    python benchmarks/recorder.py --steps 0                 # the cost per call only
    mpiexec -n 4 python benchmarks/recorder.py [--steps 4]  # and the calls per step

Cost per call (rank 0 alone, the other ranks waiting without spinning): a one-rank
Allreduce of one double on a duplicate of ``COMM_SELF``, so that what is timed is the
call's own overhead. Rounds alternate the variants, ``--calls`` calls each: raw mpi4py (a
communicator mpidist never saw), the traced wrapper with no hook, the traced wrapper with
the flight recorder (its hook appends the call to a ring: a C-level ``deque.append``), and,
for comparison, the traced wrapper with a hook whose ``enter`` is a Python method doing the
same append. Medians in ns per call.

Calls per step (every rank): ``mpidist train``'s loop (``run_training`` in this process) on
the GPT 4x128 (TrainConfig's defaults, on the embedded byte corpus: GPT 4x128, global batch
32 x 64 tokens; `make run`'s model while it trained on bytes, kept for comparable figures) for
``--steps`` steps under ddp, zero3 and hybrid (pp 2 x tp 2 where the ranks allow, else
pp 2); the flight recorder's ring gives the MPI calls each rank made in the middle steps
(the first one warms up, the last one evaluates and checkpoints), the most of any rank.
Calls per step x the recorder's ns per call = its cost per step, set against the step's
median time from metrics.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from mpidist.core import comms, recorder


class _PythonHook:
    """The same append as the recorder's hook, as a Python method (for comparison)."""

    def __init__(self) -> None:
        import collections

        self.ring: Any = collections.deque(maxlen=recorder.DEFAULT_SIZE)

    def enter(self, call: Any) -> None:
        self.ring.append(call)


def allreduce_ns(comm: Any, buf: np.ndarray, n: int) -> float:
    """ns per call of ``n`` in-place ``Allreduce`` of ``buf`` on ``comm``."""
    inplace = comms.in_place()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        comm.Allreduce(inplace, buf)
    return (time.perf_counter_ns() - t0) / n


def cost_per_call(calls: int, rounds: int) -> dict[str, float]:
    """Median ns per call of each variant (see the module docstring). Not collective."""
    MPI = comms.mpi()
    raw = MPI.COMM_SELF.Dup()
    traced = comms.traced(MPI.COMM_SELF.Dup())
    ring, python_hook = recorder.hook(), _PythonHook()
    buf = np.zeros(1)
    variants = {"raw mpi4py": (raw, None), "traced, no hook": (traced, None),
                "traced + flight recorder": (traced, ring),
                "traced + Python-method hook": (traced, python_hook)}
    for h in (ring, python_hook):
        comms.remove_hook(h)
    times: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for _ in range(rounds + 1):  # (the first round warms up)
            for name, (comm, h) in variants.items():
                if h is not None:
                    comms.add_hook(h)
                try:
                    times[name].append(allreduce_ns(comm, buf, calls))
                finally:
                    if h is not None:
                        comms.remove_hook(h)
    finally:
        comms.add_hook(ring)
        raw.Free()
        traced.Free()
    out = {k: statistics.median(v[1:]) for k, v in times.items()}
    # the recorder's own cost: the median of each round's difference (adjacent in time)
    out["recorder's own"] = statistics.median(
        a - b for a, b in zip(times["traced + flight recorder"][1:],
                              times["traced, no hook"][1:], strict=True))
    return out


def calls_per_step(strategy: str, steps: int, world: Any, args: argparse.Namespace,
                   where: str) -> tuple[int, float]:
    """(the most MPI calls any rank made per middle step, the median step seconds) of
    ``mpidist train`` under ``strategy``. Collective over ``world``."""
    from mpidist.run import TrainConfig, run_training

    size = world.Get_size()
    layout = {}
    if strategy == "hybrid":
        layout = {"pp": 2, "tp": 2} if size % 4 == 0 else {"pp": 2} if size % 2 == 0 else {}
    cfg = TrainConfig(out=os.path.join(where, strategy), strategy=strategy, steps=steps,
                      eval_interval=0, eval_batches=1, checkpoint_interval=0,
                      progress=False, overwrite=True, n_layer=args.n_layer,
                      n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                      global_batch=args.global_batch, **layout)
    start = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()):
        run_training(cfg, world)
    middle = range(2, steps)
    mine = sum(1 for c in recorder.recent() if c.t_enter >= start and c.step in middle)
    most = max(world.allgather(mine)) // max(len(middle), 1)
    seconds = 0.0
    if world.Get_rank() == 0:
        with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        seconds = statistics.median(r["seconds"] for r in rows
                                    if r.get("split") == "train" and r["step"] in middle)
    return most, comms.bcast_json(seconds, world)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000, help="calls per variant and round")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=4, help="training steps per strategy "
                   "(0: the cost per call only; at least 3 to have a middle step)")
    p.add_argument("--strategies", default="ddp,zero3,hybrid")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=32)
    args = p.parse_args()
    if args.steps and args.steps < 3:
        p.error("--steps must be 0 or at least 3")
    world = comms.world()
    recorder.install()
    rank, size = world.Get_rank(), world.Get_size()
    cost: dict[str, float] = {}
    if rank == 0:
        cost = cost_per_call(args.calls, args.rounds)
    req = world.Ibarrier()  # the others wait here without spinning on the cores
    while not req.Test():
        time.sleep(0.01)
    cost = comms.bcast_json(cost, world)
    own = cost.pop("recorder's own")
    if rank == 0:
        raw = cost["raw mpi4py"]
        print(f"cost per call: one-rank Allreduce of one double, median of {args.rounds} "
              f"rounds x {args.calls} calls")
        print(f"{'variant':<30} {'ns/call':>8} {'x raw':>7}")
        for name, ns in cost.items():
            print(f"{name:<30} {ns:8.0f} {ns / raw:7.2f}")
        print(f"the flight recorder's own cost: {own:.0f} ns per call (median of the rounds' "
              f"differences; the traced wrapper's: {cost['traced, no hook'] - raw:.0f} ns)")
    if not args.steps:
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        where = comms.bcast_json(tmp, world)
        for strategy in args.strategies.split(","):
            rows.append((strategy, *calls_per_step(strategy, args.steps, world, args, where)))
    if rank == 0:
        print(f"\ncalls per step: mpidist train, GPT {args.n_layer}x{args.n_embd}, global "
              f"batch {args.global_batch} x {args.block_size}, {size} rank(s), steps 2-"
              f"{args.steps - 1}")
        print(f"{'strategy':<10} {'calls/step':>10} {'recorder us/step':>17} "
              f"{'step ms':>9} {'share':>9}")
        for strategy, n, seconds in rows:
            us = n * own / 1e3
            share = us / (seconds * 1e6) if seconds > 0 else 0.0
            print(f"{strategy:<10} {n:10d} {us:17.1f} {seconds * 1e3:9.1f} {share:9.2e}")


if __name__ == "__main__":
    main()
