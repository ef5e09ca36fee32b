"""mpidist collectives next to raw mpi4py on the same buffers, in the same run.

    mpiexec -n 4 python benchmarks/collectives.py [--max-mb 64] [--json FILE]

For each message size (float32, 1 KB to 64 MB) it times mpidist's allreduce, allgather
and reduce_scatter and the raw mpi4py call they wrap (``Allreduce(IN_PLACE)``,
``Allgather``, ``Reduce_scatter_block``) on the same preallocated buffers, alternating the
two in every repetition so both see the same machine state. A repetition's time is the
slowest rank's; the table gives medians and the ratio mpidist / raw (goal: <= 1.05 for
messages of 1 MB and more). Sizes are per rank for allreduce and reduce_scatter input, and
the gathered total for allgather.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

from mpidist.core import collectives as C


def timed(fn, comm) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_size(comm, nbytes: int, reps: int) -> dict[str, tuple[float, float]]:
    n = comm.Get_size()
    count = max(n, nbytes // 4 // n * n)
    x = np.random.default_rng(comm.Get_rank()).standard_normal(count).astype(np.float32)
    shard = np.empty(count // n, dtype=np.float32)
    full = np.empty(count, dtype=np.float32)
    pairs = {
        "allreduce": (
            lambda: C.allreduce(x, "sum", comm=comm),
            lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM),
        ),
        "allgather": (
            lambda: C.allgather(shard, comm=comm, out=full),
            lambda: comm.Allgather(shard, full),
        ),
        "reduce_scatter": (
            lambda: C.reduce_scatter(x, "sum", comm=comm, out=shard),
            lambda: comm.Reduce_scatter_block(x, shard, op=MPI.SUM),
        ),
    }
    out = {}
    for name, (ours, raw) in pairs.items():
        for _ in range(2):  # warm up both paths
            ours()
            raw()
        t = np.zeros((2, reps))
        for i in range(reps):
            if i % 2:
                t[0, i] = timed(ours, comm)
                t[1, i] = timed(raw, comm)
            else:
                t[1, i] = timed(raw, comm)
                t[0, i] = timed(ours, comm)
            x *= 0.5  # keep values bounded across repeated sums
        comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
        out[name] = (float(np.median(t[0])), float(np.median(t[1])))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-kb", type=int, default=1)
    p.add_argument("--max-mb", type=int, default=64)
    p.add_argument("--json", help="also write the rows to this file (rank 0)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    sizes = []
    s = args.min_kb * 1024
    while s <= args.max_mb * 2**20:
        sizes.append(s)
        s *= 4
    rows = []
    if rank == 0:
        lib = MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()
        print(f"# {n} ranks, {lib}")
        print(f"{'op':<15}{'bytes':>10}{'mpidist ms':>12}{'raw ms':>10}{'ratio':>8}")
    for nbytes in sizes:
        reps = int(min(200, max(10, 2e8 / max(nbytes, 1) / 8)))
        res = bench_size(comm, nbytes, reps)
        for op, (ours, raw) in res.items():
            row = {"ranks": n, "op": op, "bytes": nbytes, "mpidist_ms": ours * 1e3,
                   "raw_ms": raw * 1e3, "ratio": ours / raw}
            rows.append(row)
            if rank == 0:
                label = f"{nbytes // 1024} KB" if nbytes < 2**20 else f"{nbytes // 2**20} MB"
                print(f"{op:<15}{label:>10}{ours * 1e3:>12.3f}{raw * 1e3:>10.3f}"
                      f"{ours / raw:>8.3f}")
    if rank == 0:
        big = [r["ratio"] for r in rows if r["bytes"] >= 2**20]
        print(f"# messages >= 1 MB: worst ratio {max(big):.3f}, median "
              f"{float(np.median(big)):.3f} (goal <= 1.05)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
