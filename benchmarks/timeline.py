"""The timeline's cost: per event recorded, events per training step, and training with
``--trace`` against training without it, as the median of interleaved pairs.

    python benchmarks/timeline.py --steps 0                  # the cost per event only
    mpiexec -n 4 python benchmarks/timeline.py [--pairs 5]    # and steps, traced vs not

Cost per event (rank 0 alone, the other ranks waiting without spinning), medians of
``--rounds`` rounds that alternate the variants, ``--events`` events each:

- an MPI call (a one-rank ``Allreduce`` of one double on a duplicate of ``COMM_SELF``):
  the traced wrapper with no hook, with the trace recorder (its ``enter`` is a list's
  ``append``), and with the per-rank clock that ``mpidist train`` always keeps (a Python
  ``exit`` method);
- a marked block (``with span(...)``, as a unit's forward is): with no recorder (tracing
  off: a function call and a comparison) and with one recording;
- a phase (``with phase(...)``): with no hook, and with the recorder's ``span`` seeing it;
- turning the recorded events into Chrome trace JSON at the window's end.

Events per step (every rank): ``mpidist train``'s loop (``run_training`` in this process)
on ``--n-layer``/``--n-embd``/... (make run's model by default) under ddp, zero3 and hybrid
(pp 2, and tp 2 where the ranks allow), the trace window on steps 2 to ``--steps``; the
most events any rank recorded per step x the recording cost per event = the recording
cost per step, set against the step's median time.

Traced vs not (``--pairs``): the same run without ``--trace`` and with it on steps 2 to
``--steps``, alternated ``--pairs`` times (after one warm-up run); each pair gives the
ratio of the medians of its two runs' step times over steps 2 to ``--steps``; the median of
the pairs' ratios is the figure (1.00: no cost), with their range.
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
from recorder import allreduce_ns  # benchmarks/recorder.py (the script's directory)

from mpidist.core import calls, comms
from mpidist.core import timeline as T


def _spans_ns(n: int) -> float:
    span = T.span
    t0 = time.perf_counter_ns()
    for i in range(n):
        with span("forward unit", "unit", micro_batch=i):
            pass
    return (time.perf_counter_ns() - t0) / n


def _phases_ns(n: int) -> float:
    phase = calls.phase
    t0 = time.perf_counter_ns()
    for _ in range(n):
        with phase("forward"):
            pass
    return (time.perf_counter_ns() - t0) / n


def cost_per_event(n: int, rounds: int) -> dict[str, float]:
    """Median ns per event of each variant and the hooks' own costs (differences of
    adjacent measurements). Not collective."""
    comm = comms.traced(comms.mpi().COMM_SELF.Dup())
    buf = np.zeros(1)
    clock = T.PhaseClock()
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Any, hook: Any = None, record: bool = False) -> None:
        rec = T.Recorder() if record else None
        if hook is not None:
            comms.add_hook(hook)
        if rec is not None:
            rec.start()
        try:
            times.setdefault(name, []).append(fn())
        finally:
            if rec is not None:
                rec.stop()
            if hook is not None:
                comms.remove_hook(hook)

    try:
        for _ in range(rounds + 1):  # (the first round warms up)
            timed("call, no timeline hook", lambda: allreduce_ns(comm, buf, n))
            timed("call, trace recorder", lambda: allreduce_ns(comm, buf, n), record=True)
            timed("call, per-rank clock", lambda: allreduce_ns(comm, buf, n), hook=clock)
            timed("block, tracing off", lambda: _spans_ns(n))
            timed("block, recording", lambda: _spans_ns(n), record=True)
            timed("phase, no timeline hook", lambda: _phases_ns(n))
            timed("phase, trace recorder", lambda: _phases_ns(n), record=True)
            timed("phase, per-rank clock", lambda: _phases_ns(n), hook=clock)
    finally:
        comm.Free()
    out = {k: statistics.median(v[1:]) for k, v in times.items()}

    def own(a: str, b: str) -> float:
        return statistics.median(x - y for x, y in zip(times[a][1:], times[b][1:],
                                                        strict=True))

    out["recorder per call"] = own("call, trace recorder", "call, no timeline hook")
    out["clock per call"] = own("call, per-rank clock", "call, no timeline hook")
    out["recorder per block"] = own("block, recording", "block, tracing off")
    out["recorder per phase"] = own("phase, trace recorder", "phase, no timeline hook")
    out["clock per phase"] = own("phase, per-rank clock", "phase, no timeline hook")
    out["to JSON per event"] = _json_ns(min(n, 20000))
    return out


def _json_ns(n: int) -> float:
    """ns per event to turn a window's events into Chrome trace JSON (this rank's part)."""
    rec = T.Recorder()
    rec.start()
    try:
        for i in range(n):
            with T.span("forward unit", "unit", micro_batch=i):
                pass
    finally:
        rec.stop()
    t0 = time.perf_counter_ns()
    json.dumps(rec.chrome(rank=0, pid=1, alignment=T.Alignment(base=rec.t_start)))
    return (time.perf_counter_ns() - t0) / max(rec.count(), 1)


def _config(strategy: str, size: int, args: argparse.Namespace, out: str, trace: bool) -> Any:
    from mpidist.run import TrainConfig

    layout: dict[str, int] = {}
    if strategy == "hybrid":
        layout = {"pp": 2, "tp": 2} if size % 4 == 0 else {"pp": 2} if size % 2 == 0 else {}
        layout["micro_batches"] = 2
    return TrainConfig(out=out, strategy=strategy, steps=args.steps, eval_interval=0,
                       eval_batches=1, checkpoint_interval=0, progress=False, overwrite=True,
                       n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                       block_size=args.block_size, global_batch=args.global_batch,
                       trace=f"2:{args.steps}" if trace else None, **layout)


def _train(cfg: Any, world: Any) -> list[float]:
    """``run_training(cfg)``; step seconds of steps 2.. (rank 0's metrics, on every rank)."""
    from mpidist.run import run_training

    with contextlib.redirect_stdout(io.StringIO()):
        run_training(cfg, world)
    seconds: list[float] = []
    if world.Get_rank() == 0:
        with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        seconds = [r["seconds"] for r in rows if r.get("split") == "train" and r["step"] >= 2]
    return comms.bcast_json(seconds, world)


#: what each kind of event costs to record (which measurement of cost_per_event)
_KIND_COST = {"call": "recorder per call", "wait": "recorder per phase",
              "phase": "recorder per phase", "block": "recorder per block"}
#: what the always-on per-rank clock costs per event of each kind (marked blocks: nothing)
_CLOCK_COST = {"call": "clock per call", "wait": "clock per phase", "phase": "clock per phase"}


def _kind(cat: str) -> str:
    return {"mpi": "call", "mpi-async": "call", "mpi-wait": "wait", "phase": "phase"}.get(
        cat, "block")


def events_per_step(strategy: str, world: Any, args: argparse.Namespace, where: str
                    ) -> tuple[dict[str, int], float, float]:
    """(per kind of event, the events per traced step of the rank that recorded the most;
    the median step seconds; the trace file's bytes per event) under ``strategy``, from the
    trace. Collective over ``world``."""
    cfg = _config(strategy, world.Get_size(), args, os.path.join(where, strategy), True)
    seconds = _train(cfg, world)
    kinds: dict[str, int] = {}
    size = 0.0
    if world.Get_rank() == 0:
        path = os.path.join(cfg.out, "trace.json")
        with open(path) as f:
            xs = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
        per_rank: dict[int, dict[str, int]] = {}
        for e in xs:
            mine = per_rank.setdefault(e["tid"] // 1000, {})
            mine[_kind(e["cat"])] = mine.get(_kind(e["cat"]), 0) + 1
        most = max(per_rank.values(), key=lambda d: sum(d.values()))
        kinds = {k: v // max(args.steps - 1, 1) for k, v in most.items()}
        size = os.path.getsize(path) / max(len(xs), 1)
    kinds, size = comms.bcast_json([kinds, size], world)
    return kinds, statistics.median(seconds), size


def traced_vs_not(strategy: str, world: Any, args: argparse.Namespace, where: str
                  ) -> list[float]:
    """Per pair, the median step time traced / untraced. Collective over ``world``."""
    size = world.Get_size()
    off = _config(strategy, size, args, os.path.join(where, "off"), False)
    on = _config(strategy, size, args, os.path.join(where, "on"), True)
    _train(off, world)  # warm-up
    ratios = []
    for _ in range(args.pairs):
        a = statistics.median(_train(off, world))
        b = statistics.median(_train(on, world))
        ratios.append(b / a)
    return ratios


def _print_costs(cost: dict[str, float], args: argparse.Namespace) -> None:
    print(f"cost per event: median of {args.rounds} rounds x {args.events} events")
    print(f"{'variant':<28} {'ns/event':>9}")
    for name, ns in cost.items():
        print(f"{name:<28} {ns:9.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=20000, help="events per variant and round")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=8, help="training steps per run (0: the "
                   "cost per event only; at least 3)")
    p.add_argument("--pairs", type=int, default=5, help="traced/untraced pairs (0: none)")
    p.add_argument("--strategies", default="ddp,zero3,hybrid")
    p.add_argument("--pair-strategy", default="zero3")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=32)
    args = p.parse_args()
    if args.steps and args.steps < 3:
        p.error("--steps must be 0 or at least 3")
    world = comms.world()
    rank, size = world.Get_rank(), world.Get_size()
    cost: dict[str, float] = {}
    if rank == 0:
        cost = cost_per_event(args.events, args.rounds)
    req = world.Ibarrier()  # the others wait here without spinning on the cores
    while not calls.test_all([req]):
        time.sleep(0.01)
    cost = comms.bcast_json(cost, world)
    if rank == 0:
        _print_costs(cost, args)
    if not args.steps:
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        where = comms.bcast_json(tmp, world)
        for strategy in args.strategies.split(","):
            rows.append((strategy, *events_per_step(strategy, world, args, where)))
        ratios = traced_vs_not(args.pair_strategy, world, args, where) if args.pairs else []
    if rank != 0:
        return
    print(f"\nevents per step: mpidist train --trace 2:{args.steps}, GPT {args.n_layer}x"
          f"{args.n_embd}, global batch {args.global_batch} x {args.block_size}, {size} "
          "rank(s); the rank that recorded the most")
    print(f"{'strategy':<10} {'calls':>6} {'waits':>6} {'phases':>6} {'blocks':>6} "
          f"{'record us/step':>15} {'step ms':>9} {'share':>9} {'JSON us/step':>13} "
          f"{'B/event':>8} {'clock us/step':>14}")
    for strategy, kinds, seconds, nbytes in rows:
        us = sum(n * cost[_KIND_COST[k]] for k, n in kinds.items()) / 1e3
        json_us = sum(kinds.values()) * cost["to JSON per event"] / 1e3
        clock_us = sum(n * cost[_CLOCK_COST[k]] for k, n in kinds.items()
                       if k in _CLOCK_COST) / 1e3
        print(f"{strategy:<10} {kinds.get('call', 0):6d} {kinds.get('wait', 0):6d} "
              f"{kinds.get('phase', 0):6d} {kinds.get('block', 0):6d} {us:15.1f} "
              f"{seconds * 1e3:9.1f} {us / (seconds * 1e6):9.2e} {json_us:13.1f} "
              f"{nbytes:8.0f} {clock_us:14.1f}")
    if ratios:
        print(f"\ntraced / untraced step time, {args.pair_strategy}, {len(ratios)} interleaved "
              f"pair(s): median {statistics.median(ratios):.3f} (pairs {min(ratios):.3f}-"
              f"{max(ratios):.3f})")


if __name__ == "__main__":
    main()
