"""Pipeline bubble: measured idle fraction of GPipe and 1F1B next to (p-1)/(m+p-1).

Usage::

    mpiexec -n 4 python benchmarks/pipeline_bubble.py [--micro 4 8] [--width 384] [--steps 5]

Runs pipelines of p = 2 and p = 4 stages (p <= the world size; smaller pipelines run on
disjoint groups of ranks at once and group 0 is reported) over m micro-batches. Every stage
is the same stack of dense layers, so stage times are equal, the case the ideal formula
assumes. A stage's idle time is the time it waits in receives (measured by
:class:`mpidist.parallel.pipeline.PipelineStage`); the idle fraction is idle time over the
schedule's wall time, averaged over the stages and the timed steps. Also printed: the peak
number of live micro-batches (forward done, backward not yet) over the stages, which is m
for GPipe and at most p for 1F1B. Needs one core per rank for meaningful timings.
"""

from __future__ import annotations

import argparse
import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro", type=int, nargs="+", default=[4, 8], help="micro-batch counts")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="pipeline sizes")
    p.add_argument("--width", type=int, default=384, help="width of the dense layers")
    p.add_argument("--layers", type=int, default=2, help="dense layers per stage")
    p.add_argument("--micro-batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after 1 warm-up step)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import numpy as np
    from mpi4py import MPI

    from mpidist.nn import MLP, MSELoss
    from mpidist.parallel.pipeline import PipelineStage, bubble_fraction

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    rows = []
    for p in args.stages:
        if p > size:
            if rank == 0:
                print(f"skipping pp={p}: needs {p} ranks, have {size}")
            continue
        active = rank < (size // p) * p
        comm = world.Split(rank // p if active else MPI.UNDEFINED, rank)
        for schedule in ("gpipe", "1f1b"):
            for m in args.micro:
                idle = live = 0.0
                if active:
                    w = args.width
                    model = MLP([w] * (args.layers + 1), activation="relu")
                    model.build(np.float64, seed=comm.Get_rank())
                    loss = MSELoss()
                    rng = np.random.default_rng(0)
                    xs = [rng.standard_normal((args.micro_batch_size, w)) for _ in range(m)]
                    ys = [rng.standard_normal((args.micro_batch_size, w)) for _ in range(m)]
                    stage = PipelineStage(model.forward, model.backward, comm=comm, loss=loss)
                    fractions = []
                    for step in range(args.steps + 1):
                        comm.Barrier()
                        stage.run(xs, ys, schedule=schedule)
                        if step:
                            fractions.append(stage.stats.idle_fraction)
                    mine = np.array([np.mean(fractions), stage.stats.peak_live])
                    total = np.zeros(2)
                    comm.Allreduce(mine[:1], total[:1], op=MPI.SUM)
                    comm.Allreduce(mine[1:], total[1:], op=MPI.MAX)
                    idle, live = total[0] / p, total[1]
                rows.append((schedule, p, m, idle, bubble_fraction(p, m), int(live)))
        if comm != MPI.COMM_NULL:
            comm.Free()
    if rank == 0:
        print(f"pipeline bubble: {args.layers} dense layers of width {args.width} per stage, "
              f"micro-batch {args.micro_batch_size}, {args.steps} timed steps, "
              f"{size} ranks")
        print(f"{'schedule':>8} {'pp':>3} {'m':>3} {'idle':>7} {'(p-1)/(m+p-1)':>14} "
              f"{'ratio':>6} {'peak live':>10}")
        for schedule, p, m, idle, ideal, live in rows:
            print(f"{schedule:>8} {p:>3} {m:>3} {idle:>7.3f} {ideal:>14.3f} "
                  f"{idle / ideal:>6.2f} {live:>10d}")


if __name__ == "__main__":
    main()
