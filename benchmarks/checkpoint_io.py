"""Checkpoint save/load throughput next to raw file I/O of the same bytes, in the same run.

    mpiexec -n 4 python benchmarks/checkpoint_io.py [--size-mb 1024] [--tensors 300]
        [--dir DIR] [--repeats 5] [--json FILE]

State: ``--size-mb`` of float32 split into ``--tensors`` tensors with odd shapes, grouped
into units and sharded over the ranks with ``ShardedLayout`` (ZeRO-style pieces that do not
align with rows). Per repetition it times, with a Barrier before and after each:

* raw write: every rank ``tofile`` of its shard's bytes to its own file, then ``fsync``;
  each repetition writes new files (as training writes a new checkpoint file each time),
  the previous repetition's being deleted before the clock starts;
* save: :func:`save_checkpoint` (checksums, parallel HDF5 or the serial fallback, fsync,
  atomic rename, ``latest`` pointer);
* raw read: every rank ``fromfile`` of its file;
* load: :func:`read_pieces` of the same pieces, with and without checksum verification.

Before the reads every rank asks the kernel to evict the files from the page cache with
``posix_fadvise(DONTNEED)`` (the written pages are clean after fsync). That is best effort:
on some file systems, or with little memory pressure, reads may still be served from page
cache, for the raw read and the load alike. Throughput is total bytes over the slowest
rank's time; the ratio mpidist / raw is the goal metric (>= 0.7), printed for the best and
the median repetition of each (a shared disk's speed drifts between repetitions).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np
from mpi4py import MPI

from mpidist.checkpoint import Piece, TensorInfo, read_pieces, save_checkpoint
from mpidist.core.buffers import ShardedLayout


def make_units(total_bytes: int, n_tensors: int, per_unit: int = 12):
    """Odd-shaped float32 tensors adding up to about ``total_bytes``, in units."""
    rng = np.random.default_rng(0)
    weights = rng.uniform(0.2, 1.8, n_tensors)
    numels = np.maximum(7, (weights / weights.sum() * total_bytes / 4).astype(np.int64))
    units, unit = [], []
    for i, numel in enumerate(numels):
        cols = int(rng.choice([7, 129, 1023, 1531]))
        rows = max(1, int(numel) // cols)
        group = "params" if i % 3 == 0 else ("optimizer/exp_avg" if i % 3 == 1
                                              else "optimizer/exp_avg_sq")
        unit.append((f"{group}/layer{i // 3}.w", (rows, cols)))
        if len(unit) == per_unit:
            units.append(unit)
            unit = []
    if unit:
        units.append(unit)
    return units


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(comm, fn) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    comm.Barrier()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=1024.0, help="total state in MB")
    ap.add_argument("--tensors", type=int, default=300, help="number of tensors")
    ap.add_argument("--dir", default=None, help="directory on the file system to test "
                    "(default: the system temp directory)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="repetitions; the best and the median are shown")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    units = make_units(int(args.size_mb * 1e6), args.tensors)
    layout = ShardedLayout(units, size, rank)
    tensors = {name: TensorInfo(tuple(shape), "float32") for u in units for name, shape in u}
    total = sum(i.nbytes for i in tensors.values())
    local = np.random.default_rng(rank).standard_normal(layout.local_size).astype(np.float32)
    pieces = [Piece(n, flat, local[loc]) for n, flat, loc in layout.local_pieces()]
    local_bytes = sum(p.data.nbytes for p in pieces)
    raw_data = np.concatenate([p.data for p in pieces]) if pieces else local[:0]

    base = tempfile.mkdtemp(prefix="mpidist-bench-ckpt-", dir=args.dir) if rank == 0 else None
    base = comm.bcast(base, root=0)
    outs = [Piece(p.name, p.flat, np.empty_like(p.data)) for p in pieces]
    times: dict[str, list[float]] = {}
    try:
        for rep in range(args.repeats):
            # Fresh names every repetition for both, as training writes a new file per
            # checkpoint; the previous repetition's files are deleted before the clock
            # starts (freeing a replaced file's blocks is otherwise timed into the rename
            # or the truncation).
            raw_path = os.path.join(base, f"raw-{rep}-{rank}.bin")
            ckpt = os.path.join(base, f"ckpt-{rep + 1:08d}.h5")
            if rep:
                os.remove(os.path.join(base, f"raw-{rep - 1}-{rank}.bin"))
                if rank == 0:
                    os.remove(os.path.join(base, f"ckpt-{rep:08d}.h5"))
            comm.Barrier()

            def raw_write(raw_path: str = raw_path) -> None:
                with open(raw_path, "wb") as fh:
                    raw_data.tofile(fh)
                    fh.flush()
                    os.fsync(fh.fileno())

            t = {"raw write": timed(comm, raw_write),
                 "save": timed(comm, lambda ckpt=ckpt: save_checkpoint(
                     ckpt, tensors, pieces, {"step": 1, "world_size": size}, comm=comm))}
            drop_cache(raw_path)
            if rank == 0:
                drop_cache(ckpt)
            comm.Barrier()
            t["raw read"] = timed(comm, lambda raw_path=raw_path: np.fromfile(
                raw_path, dtype=np.float32))
            t["load (verified)"] = timed(comm, lambda ckpt=ckpt: read_pieces(ckpt, outs, comm=comm))
            drop_cache(ckpt)
            comm.Barrier()
            t["load (no verify)"] = timed(
                comm, lambda ckpt=ckpt: read_pieces(ckpt, outs, comm=comm, verify=False))
            if not all(o.data.tobytes() == p.data.tobytes() for o, p in zip(outs, pieces,
                                                                             strict=True)):
                raise SystemExit(f"[rank {rank}] loaded data differs from saved data")
            for k, v in t.items():
                times.setdefault(k, []).append(v)
    finally:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)

    if rank == 0:
        stats = {"best": {k: min(v) for k, v in times.items()},
                 "median": {k: float(np.median(v)) for k, v in times.items()}}
        gbs = {s: {k: total / v / 1e9 for k, v in d.items()} for s, d in stats.items()}
        print(f"checkpoint I/O: {size} rank(s), {len(tensors)} tensors, {total / 1e9:.3f} GB "
              f"({local_bytes / 1e6:.1f} MB on rank 0), dir {os.path.dirname(base)}, "
              f"{args.repeats} repetitions")
        print("reads follow posix_fadvise(DONTNEED) on every file; they may still come "
              "partly from page cache")
        print(f"  {'':<18} {'best s':>8} {'GB/s':>7}   {'median s':>8} {'GB/s':>7}")
        for k in times:
            print(f"  {k:<18} {stats['best'][k]:8.3f} {gbs['best'][k]:7.3f}   "
                  f"{stats['median'][k]:8.3f} {gbs['median'][k]:7.3f}")
        pairs = {"save / raw write": ("save", "raw write"),
                 "load (verified) / raw read": ("load (verified)", "raw read"),
                 "load (no verify) / raw read": ("load (no verify)", "raw read")}
        ratios = {s: {k: gbs[s][a] / gbs[s][b] for k, (a, b) in pairs.items()} for s in gbs}
        print(f"  {'throughput ratio':<28} {'best':>6} {'median':>7}  (goal >= 0.7)")
        for k in pairs:
            print(f"  {k:<28} {ratios['best'][k]:5.2f}x {ratios['median'][k]:6.2f}x")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"world_size": size, "bytes": total, "tensors": len(tensors),
                           "seconds": times, "gb_per_s": gbs, "ratios": ratios}, fh, indent=1)


if __name__ == "__main__":
    main()
