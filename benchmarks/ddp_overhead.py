"""DDP gradient synchronisation against the limit: one raw Allreduce of the same bytes.

    mpiexec -n 4 python benchmarks/ddp_overhead.py [--layers 50] [--width 256]

The model is an MLP with ``2 * layers`` parameter tensors (default 100). For the same
gradient bytes, in the same run, it times:

* ``raw``: one ``MPI.Allreduce(IN_PLACE)`` of the whole flat gradient (the limit);
* ``per-tensor``: one Allreduce per parameter tensor (what naive DDP does);
* ``mpidist DDP``: ``DDPModel``'s bucketed nonblocking allreduces (started and waited),
  at the default bucket size and at a small one that makes many buckets;
* ``step, overlap on/off``: a whole training step with bucket allreduces started during
  backward (overlap) or after it.

Repetitions alternate the variants; a repetition's time is the slowest rank's; the table
gives medians and the ratio to the limit (goal for DDP: <= 1.10).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpidist.core.mesh import ProcessMesh
from mpidist.nn import MLP, MSELoss
from mpidist.optim import SGD
from mpidist.parallel import DDPOptimizer, ShardingConfiguration


def timed(comm, fn) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=50)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    sizes = [args.width] * (args.layers + 1)

    def make(bucket_mb: float, overlap: bool = True):
        cfg = ShardingConfiguration(mesh=ProcessMesh(comm), dtype="float32",
                                    bucket_mb=bucket_mb, overlap=overlap)
        opt = DDPOptimizer(SGD(lr=1e-3), cfg, loss=MSELoss())
        return opt, opt.wrap(MLP(sizes))

    opt_big, big = make(25.0)
    _, small = make(1.0)
    opt_noov, noov = make(1.0, overlap=False)
    opt_ov, ov = make(1.0, overlap=True)
    n_tensors = len(big.layout.names)
    grads = big.grads
    rng = np.random.default_rng(rank)
    # Zero gradients stay zero under repeated sums, so no refill (and no copy to subtract)
    # is needed between repetitions; the reduction does the same work on any values.
    grads.fill(0)
    views = [v.reshape(-1) for v in big.layout.full_views(grads).values()]
    x = rng.standard_normal((16, args.width)).astype(np.float32)
    y = rng.standard_normal((16, args.width)).astype(np.float32)

    def ddp_sync(model):
        model.grads.fill(0)

        def run():
            model.sync_gradients()
            model.finish_gradient_sync()
        return run

    def raw():
        comm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)

    def per_tensor():
        for v in views:
            comm.Allreduce(MPI.IN_PLACE, v, op=MPI.SUM)

    variants = {
        "raw Allreduce (limit)": raw,
        "per-tensor Allreduce": per_tensor,
        f"mpidist DDP, {len(big.buckets)} bucket(s) of 25 MB": ddp_sync(big),
        f"mpidist DDP, {len(small.buckets)} buckets of 1 MB": ddp_sync(small),
        "training step, overlap off": lambda: opt_noov.step(noov, (x, y)),
        "training step, overlap on": lambda: opt_ov.step(ov, (x, y)),
    }
    for fn in variants.values():  # warm up
        fn()
    times = np.zeros((len(variants), args.reps))
    for i in range(args.reps):
        order = list(enumerate(variants.values()))
        if i % 2:
            order.reverse()
        for k, fn in order:
            times[k, i] = timed(comm, fn)
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    med = np.median(times, axis=1)
    limit = med[0]
    if rank == 0:
        mb = grads.nbytes / 2**20
        print(f"# {n} ranks; MLP with {n_tensors} parameter tensors, {grads.size:,} floats "
              f"({mb:.1f} MB of gradients); medians of {args.reps}")
        print(f"{'variant':<40}{'ms':>9}{'x limit':>9}")
        for k, name in enumerate(variants):
            ratio = f"{med[k] / limit:>9.3f}" if k < 4 else f"{'':>9}"
            print(f"{name:<40}{med[k] * 1e3:>9.3f}{ratio}")


if __name__ == "__main__":
    main()
