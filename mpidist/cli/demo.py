"""``mpidist demo``: a short tour of the foundation on however many ranks it is launched.

It builds a ProcessMesh, prints the rank layout, averages the gradients of a synthetic
100-tensor model through bucketed nonblocking allreduces on a flat buffer, does one
ZeRO-style sharded update (reduce-scatter, local update of the shard, in-place allgather),
checks every result against the arithmetic, and writes a JSON summary under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

__all__ = ["add_parser", "run_demo"]


def add_parser(sub: Any) -> None:
    """Register the ``demo`` subcommand."""
    p = sub.add_parser("demo", help="a short tour of mesh, collectives and flat buffers")
    p.add_argument("--out", default="runs/demo", help="directory for demo.json")
    p.add_argument("--tensors", type=int, default=100, help="tensors in the synthetic model")
    p.add_argument("--bucket-mb", type=float, default=0.25, help="bucket size in MB")
    p.set_defaults(
        func=lambda a: run_demo(out=a.out, n_tensors=a.tensors, bucket_mb=a.bucket_mb) and 0
    )


def run_demo(*, out: str, n_tensors: int = 100, bucket_mb: float = 1.0, comm: Any = None) -> dict:
    """Run the demo. Collective over ``comm`` (default COMM_WORLD); returns the summary."""
    from mpi4py import MPI

    from mpidist.core import collectives as C
    from mpidist.core.buffers import FlatBuffer
    from mpidist.core.comms import world
    from mpidist.core.mesh import ProcessMesh

    if n_tensors < 1:
        raise ValueError(f"--tensors={n_tensors} must be >= 1")
    if bucket_mb <= 0:
        raise ValueError(f"--bucket-mb={bucket_mb} must be > 0")
    comm = world(comm)
    size, rank = comm.Get_size(), comm.Get_rank()
    tp = 2 if size % 2 == 0 and size > 2 else 1
    mesh = ProcessMesh(comm, tp=tp)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"mpidist demo on {size} rank(s): mesh pp={mesh.shape.pp} dp={mesh.shape.dp} "
        f"tp={mesh.shape.tp}")
    coords = np.array([mesh.coords[d] for d in ("pp", "dp", "tp")], dtype=np.int64)
    table = C.allgather(coords, comm=comm).reshape(size, 3)
    for r, (i, j, k) in enumerate(table):
        say(f"  rank {r}: pp={i} dp={j} tp={k}")

    dp = mesh.group("dp")
    n_dp, r_dp = dp.Get_size(), dp.Get_rank()
    rng = np.random.default_rng(0)
    shapes = [(f"layer{i}.weight", (int(rng.integers(8, 64)), int(rng.integers(8, 64))))
              for i in range(n_tensors)]
    grads = FlatBuffer(shapes, np.float32, pad_to=n_dp)
    # Rank q's gradient is (q + 1) * base, so the dp average is base * (n_dp + 1) / 2.
    base = np.linspace(-1, 1, grads.data.shape[0], dtype=np.float32)
    grads.data[:] = base * (r_dp + 1)
    buckets = grads.buckets(int(bucket_mb * 2**20))
    t0 = time.perf_counter()
    pending = [C.iallreduce(grads.data[b.start:b.stop], "avg", comm=dp) for b in buckets]
    C.wait_all(pending)
    t_bucketed = time.perf_counter() - t0
    err = float(np.max(np.abs(grads.data - base * (n_dp + 1) / 2)))
    raw = (base * (r_dp + 1)).astype(np.float32)
    t0 = time.perf_counter()
    if n_dp > 1:
        dp.Allreduce(MPI.IN_PLACE, raw, op=MPI.SUM)
    t_raw = time.perf_counter() - t0
    say(f"bucketed gradient average: {len(shapes)} tensors, {grads.numel} floats in "
        f"{len(buckets)} buckets, max error {err:.2e}; {t_bucketed * 1e3:.2f} ms "
        f"(one raw Allreduce of the same bytes: {t_raw * 1e3:.2f} ms)")

    params = FlatBuffer(shapes, np.float32, pad_to=n_dp)
    params.data[:] = 1.0
    grads.data[:] = base * (r_dp + 1)
    shard = C.reduce_scatter(grads.data, "avg", comm=dp)
    lo, hi = params.shard_range(r_dp, n_dp)
    params.data[lo:hi] -= 0.1 * shard  # the local shard's SGD step
    C.allgather_inplace(params.data, comm=dp)
    expected = 1.0 - 0.1 * base * (n_dp + 1) / 2
    zero_err = float(np.max(np.abs(params.data - expected)))
    check = params.data[: params.numel].astype(np.float64).sum()
    sums = C.allgather(np.array([check]), comm=comm)
    same = bool(np.all(sums == sums[0]))
    say(f"sharded update (reduce-scatter -> shard update -> allgather): max error "
        f"{zero_err:.2e}; parameters identical on all ranks: {same}")
    summary = {
        "world_size": size,
        "mesh": {"pp": mesh.shape.pp, "dp": mesh.shape.dp, "tp": mesh.shape.tp},
        "tensors": n_tensors,
        "elements": grads.numel,
        "buckets": len(buckets),
        "bucketed_allreduce_ms": t_bucketed * 1e3,
        "raw_allreduce_ms": t_raw * 1e3,
        "allreduce_max_error": err,
        "sharded_update_max_error": zero_err,
        "replicas_identical": same,
    }
    ok = err < 1e-5 and zero_err < 1e-5 and same
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "demo.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(f"{'OK' if ok else 'FAILED'}: summary written to {os.path.join(out, 'demo.json')}")
    mesh.free()
    if not ok:
        raise RuntimeError(f"demo check failed: {summary}")
    return summary


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - `python -m mpidist.cli.demo`
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    add_parser(sub)
    args = p.parse_args(["demo", *(argv or [])])
    args.func(args)
    return 0
