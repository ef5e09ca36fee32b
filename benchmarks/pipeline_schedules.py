"""Pipeline schedules measured against their simulation: GPipe, 1F1B, interleaved and
zero-bubble.

Usage::

    mpiexec -n 2 python benchmarks/pipeline_schedules.py [--micro 4] [--width 512] [--steps 7]
        [--virtual-stages 2]

Every stage is the same stack of dense layers (layer-balanced). First, on every stage, the
times of one micro-batch's forward (F), input gradient (B: ``backward_input``) and weight
gradients (W: ``backward_weight``) are measured alone, and the point-to-point latency of an
activation between the stages (half a ping-pong). Then the schedules run in turn (each
step alternates them) and each step's time (the slowest rank's) is measured; the table
gives the medians next to the step :func:`mpidist.parallel.schedules.simulate` predicts
from the measured F, B, W (each timed over all the micro-batches in turn, so on data
pushed out of the cache as in a schedule) and latency, and zero-bubble's step against
1F1B's (theory with equal F, B and W at p=2, m=4: 13/15 = 0.87). The interleaved schedule
runs the same layers as ``v`` chunks per stage (each of ``layers / v`` dense layers; chunk
``c`` of the last stage feeds chunk ``c + 1`` of the first), predicted from one chunk's
measured F, B and W (theory: the bubble divided by ``v``). One core per rank: on
the 2-core machine p=2, since an oversubscribed rank's bubble is filled by another rank's
work.
"""

from __future__ import annotations

import argparse
import os
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    p.add_argument("--width", type=int, default=512, help="width of the dense layers")
    p.add_argument("--layers", type=int, default=2, help="dense layers per stage")
    p.add_argument("--micro-batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=7, help="timed steps per schedule")
    p.add_argument("--virtual-stages", type=int, default=2,
                   help="chunks per stage of the interleaved schedule (divides --layers)")
    return p.parse_args(argv)


def _median_time(fn, repeats: int = 9) -> float:
    import numpy as np

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _phase_times(model, loss, xs, ys, last: bool) -> tuple[float, float, float]:
    """Median seconds of F, B and W of one micro-batch on this stage, each phase timed over
    all the step's micro-batches in turn (every F, then every B, then every W), so that
    each works on data other operations have pushed out of the cache, as in a schedule."""
    import numpy as np

    fs, bs, ws = [], [], []
    for _ in range(5):
        dys = []
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            t0 = time.perf_counter()
            out = model.forward(x, ctx=i)
            if last:  # the last stage's forward includes the loss, its B starts from it
                loss.forward(out, y, ctx=i)
                dys.append(loss.backward(ctx=i))
            else:
                dys.append(np.full_like(out, 1e-3))
            fs.append(time.perf_counter() - t0)
        for i, dy in enumerate(dys):
            t0 = time.perf_counter()
            model.backward_input(dy, ctx=i)
            bs.append(time.perf_counter() - t0)
        for i in range(len(xs)):
            t0 = time.perf_counter()
            model.backward_weight(ctx=i)
            ws.append(time.perf_counter() - t0)
    t_f, t_b, t_w = (float(np.median(v)) for v in (fs, bs, ws))
    return t_f, t_b, t_w


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import numpy as np
    from mpi4py import MPI

    from mpidist.nn import MLP, MSELoss
    from mpidist.parallel.pipeline import PipelineStage
    from mpidist.parallel.schedules import orders, simulate

    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    w, m, mb = args.width, args.micro, args.micro_batch_size
    model = MLP([w] * (args.layers + 1), activation="relu")
    model.build(np.float64, seed=rank)
    loss = MSELoss()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((mb, w)) for _ in range(m)]
    ys = [rng.standard_normal((mb, w)) for _ in range(m)]
    v = args.virtual_stages
    if args.layers % v:
        raise SystemExit(f"--virtual-stages {v} does not divide --layers {args.layers}")
    chunks = [MLP([w] * (args.layers // v + 1), activation="relu") for _ in range(v)]
    for c, chunk in enumerate(chunks):
        chunk.build(np.float64, seed=100 * rank + c)
    # -- the phases, alone ---------------------------------------------------------------
    mine = np.array(_phase_times(model, loss, xs, ys, rank == p - 1))
    phases = np.zeros(3)
    comm.Allreduce(mine, phases, op=MPI.MAX)
    mine = np.max([_phase_times(chunk, loss, xs, ys, rank == p - 1 and c == v - 1)
                   for c, chunk in enumerate(chunks)], axis=0)
    chunk_phases = np.zeros(3)
    comm.Allreduce(mine, chunk_phases, op=MPI.MAX)
    buf = np.zeros((mb, w))
    peer = rank ^ 1 if p > 1 else rank

    def pingpong() -> None:
        if p == 1:
            return
        if rank % 2 == 0:
            comm.Send(buf, dest=peer)
            comm.Recv(buf, source=peer)
        else:
            comm.Recv(buf, source=peer)
            comm.Send(buf, dest=peer)

    comm.Barrier()
    latency = comm.allreduce(_median_time(pingpong, 21) / 2, op=MPI.MAX)
    # -- the schedules, alternating -------------------------------------------------------
    schedules = ("gpipe", "1f1b", "interleaved", "zero-bubble")
    stages = {s: PipelineStage(model.forward, model.backward_input if s == "zero-bubble"
                               else model.backward, comm=comm, loss=loss,
                               backward_weight=model.backward_weight) for s in schedules}
    stages["interleaved"] = PipelineStage(
        lambda x, i, c: chunks[c].forward(x, ctx=i),
        lambda dy, i, c: chunks[c].backward(dy, ctx=i), comm=comm, loss=loss,
        virtual_stages=v)
    steps: dict[str, list[float]] = {s: [] for s in schedules}
    for step in range(args.steps + 1):
        for s in schedules:
            comm.Barrier()
            t0 = time.perf_counter()
            stages[s].run(xs, ys, schedule=s)
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if step:
                steps[s].append(dt)
    if rank:
        return
    f, b, wt = phases
    print(f"pipeline schedules: p={p}, m={m}, {args.layers} dense layers of width {w} per "
          f"stage, micro-batch {mb}, {args.steps} timed steps each, alternating")
    print(f"per micro-batch and stage: F {f * 1e3:.2f} ms, B {b * 1e3:.2f} ms, "
          f"W {wt * 1e3:.2f} ms; point-to-point {latency * 1e6:.0f} us")
    cf, cb, cw = chunk_phases
    print(f"per micro-batch and chunk (interleaved, v={v}): F {cf * 1e3:.2f} ms, "
          f"B {cb * 1e3:.2f} ms, W {cw * 1e3:.2f} ms")
    print(f"{'schedule':>12} {'measured ms':>12} {'predicted ms':>13} {'error':>7}")
    measured = {}
    for s in schedules:
        if s == "interleaved":
            sim = simulate(orders(s, p, m, v), f=cf, b=cb, w=cw, comm=latency)
        else:
            sim = simulate(orders(s, p, m), f=f, b=b, w=wt, comm=latency)
        measured[s] = float(np.median(steps[s]))
        print(f"{s:>12} {measured[s] * 1e3:>12.2f} {sim.step * 1e3:>13.2f} "
              f"{(measured[s] - sim.step) / sim.step:>+7.1%}")
    pred = simulate(orders("zero-bubble", p, m), f=f, b=b, w=wt, comm=latency).step / \
        simulate(orders("1f1b", p, m), f=f, b=b, w=wt, comm=latency).step
    print(f"zero-bubble / 1f1b: measured {measured['zero-bubble'] / measured['1f1b']:.3f}, "
          f"predicted {pred:.3f} (goal <= 0.9; 13/15 = 0.867 with equal F, B, W)")
    pred = simulate(orders("interleaved", p, m, v), f=cf, b=cb, w=cw, comm=latency).step / \
        simulate(orders("1f1b", p, m), f=f, b=b, w=wt, comm=latency).step
    theory = (m + (p - 1) / v) / (m + p - 1)
    print(f"interleaved / 1f1b: measured {measured['interleaved'] / measured['1f1b']:.3f}, "
          f"predicted {pred:.3f} (theory with equal chunks {theory:.3f})")


if __name__ == "__main__":
    main()
