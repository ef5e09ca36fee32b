"""Zero-bubble against 1F1B at ZeRO-3: step time and memory of the same GPT.

Usage::

    mpiexec -n 2 python benchmarks/pipeline_zero3.py [--pp 2] [--micro 4] [--steps 6]

Two HybridShardedOptimizers at ``zero_stage=3`` on the same mesh (pp from ``--pp``, dp the
ranks left), one with ``schedule="1f1b"``, one with ``"zero-bubble"``, train the same GPT
from the same weights, the steps alternating. Printed: the median step (the slowest rank's)
of each, their ratio, and per rank the memory report (``working_peak``: the largest
working set of gathered units and unit gradients) and the peak of traced allocations
during a step after the timed ones (activations included). Under zero-bubble a unit is
gathered for its forward and its input gradient (B), not for its weight gradient (W), whose
full unit gradient lives only until it is reduce-scattered. ``--zero 0`` runs the same
comparison unsharded (what the deferred W keep is the same at every level).
"""

from __future__ import annotations

import argparse
import os
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--zero", type=int, default=3, help="the sharding level of both")
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=6, help="timed steps per schedule")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import tracemalloc

    import numpy as np
    from mpi4py import MPI

    from mpidist.data import GlobalBatchSampler, TextCorpus
    from mpidist.nn import GPT, GPTConfig
    from mpidist.optim import AdamW
    from mpidist.parallel import HybridShardedOptimizer, ShardingConfiguration

    comm = MPI.COMM_WORLD
    cfg = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=4, n_embd=args.n_embd)
    data = TextCorpus(args.block_size)
    schedules = ("1f1b", "zero-bubble")
    opts, models = {}, {}
    for s in schedules:
        config = ShardingConfiguration(micro_batches=args.micro)
        opts[s] = HybridShardedOptimizer(AdamW(lr=1e-3), config, pipeline_parallel_size=args.pp,
                                         zero_stage=args.zero, schedule=s, comm=comm)
        models[s] = opts[s].wrap(GPT(cfg), seed=0)
    model = models["1f1b"]
    sampler = GlobalBatchSampler(len(data), args.global_batch, seed=0)
    times: dict[str, list[float]] = {s: [] for s in schedules}
    peaks: dict[str, int] = {s: 0 for s in schedules}
    losses: dict[str, list[float]] = {s: [] for s in schedules}
    for step in range(args.steps + 2):  # a warm-up step, the timed ones, a traced one
        batch = data.batch(sampler.local_indices(step, model.dp_rank, model.dp_size))
        traced = step == args.steps + 1
        for s in schedules:
            comm.Barrier()
            if traced:  # (tracing slows allocations: not in a timed step)
                tracemalloc.start()
            t0 = time.perf_counter()
            losses[s].append(opts[s].step(models[s], batch))
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if traced:
                peaks[s] = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
            elif step:
                times[s].append(dt)
    reports = {s: comm.gather({**opts[s].memory_report(), "traced_peak": peaks[s]})
               for s in schedules}
    same = np.allclose(losses["1f1b"], losses["zero-bubble"], rtol=1e-5)
    if comm.rank:
        return
    shape = opts["1f1b"].shape
    print(f"ZeRO-{args.zero}, pp={shape.pp} dp={shape.dp} tp={shape.tp}, m={args.micro}, GPT "
          f"n_layer={args.n_layer} n_embd={args.n_embd} block={args.block_size}, global "
          f"batch {args.global_batch}, float32; {args.steps} timed steps each, alternating; "
          f"same losses: {same}")
    med = {s: float(np.median(times[s])) for s in schedules}
    for s in schedules:
        print(f"{s:>12}: step {med[s] * 1e3:8.1f} ms")
    print(f"zero-bubble / 1f1b step: {med['zero-bubble'] / med['1f1b']:.3f}")
    print(f"{'rank':>4} {'schedule':>12} {'parameters':>11} {'gradients':>10} "
          f"{'working_peak':>13} {'traced_peak':>12}  (bytes)")
    for r in range(comm.size):
        for s in schedules:
            rep = reports[s][r]
            print(f"{r:>4} {s:>12} {rep['parameters']:>11} {rep['gradients']:>10} "
                  f"{rep['working_peak']:>13} {rep['traced_peak']:>12}")


if __name__ == "__main__":
    main()
