"""torch.distributed collectives on the "mpidist" backend against gloo and raw MPI.

Usage::

    mpiexec -n 2 python benchmarks/torch_backend.py [--sizes 4096,65536,1048576,16777216]
    mpiexec -n 4 python benchmarks/torch_backend.py --repeats 50

For each message size (bytes of float32), ``dist.all_reduce``, ``dist.all_gather_into_tensor``
and ``dist.reduce_scatter_tensor`` are timed on the default group (backend "mpidist") and on
a gloo group over the same ranks, and the same collective as one raw mpi4py call on
``MPI.COMM_WORLD`` (the floor: what the backend adds is torch's dispatch and its own Python).
The three variants alternate call by call, so that load from other processes hits all alike;
each figure is the median over ``--repeats`` calls of the slowest rank's time. Printed: the
times and the ratios gloo / mpidist and mpidist / raw MPI. A JSON file goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import mpidist.torch  # noqa: F401 - registers the backend


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4096,65536,1048576,16777216",
                   help="message sizes in bytes, comma-separated")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default="runs/bench")
    return p.parse_args()


def raw(op: str, send: torch.Tensor, recv: torch.Tensor) -> None:
    comm = MPI.COMM_WORLD
    if op == "all_reduce":
        comm.Allreduce(MPI.IN_PLACE, send.numpy())
    elif op == "all_gather":
        comm.Allgather(send.numpy(), recv.numpy())
    else:
        comm.Reduce_scatter_block(send.numpy(), recv.numpy())


def torch_op(op: str, send: torch.Tensor, recv: torch.Tensor, group) -> None:
    if op == "all_reduce":
        dist.all_reduce(send, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(recv, send, group=group)
    else:
        dist.reduce_scatter_tensor(recv, send, group=group)


def measure(op: str, nbytes: int, repeats: int, gloo) -> dict[str, float]:
    n = dist.get_world_size()
    numel = max(nbytes // 4 // n * n, n)
    send = torch.ones(numel if op != "all_gather" else numel // n)
    recv = torch.empty(numel if op == "all_gather" else numel // n)
    variants = {"mpidist": lambda: torch_op(op, send, recv, None),
                "gloo": lambda: torch_op(op, send, recv, gloo),
                "mpi": lambda: raw(op, send, recv)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(repeats + 3):
        for name, fn in variants.items():
            MPI.COMM_WORLD.Barrier()
            t0 = time.perf_counter()
            fn()
            dt = MPI.COMM_WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i >= 3:  # warm-up
                times[name].append(dt)
            send.fill_(1.0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("mpidist")
    gloo = dist.new_group(backend="gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            t = measure(op, nbytes, args.repeats, gloo)
            rows.append({"op": op, "bytes": nbytes, **t})
    if rank == 0:
        print(f"torch.distributed on {n} ranks: median of {args.repeats} calls (slowest rank)")
        print(f"{'op':15s} {'bytes':>9s} {'mpidist':>10s} {'gloo':>10s} {'raw MPI':>10s} "
              f"{'gloo/mpidist':>13s} {'mpidist/MPI':>12s}")
        for r in rows:
            print(f"{r['op']:15s} {r['bytes']:9d} {r['mpidist'] * 1e6:8.1f}us "
                  f"{r['gloo'] * 1e6:8.1f}us {r['mpi'] * 1e6:8.1f}us "
                  f"{r['gloo'] / r['mpidist']:12.2f}x {r['mpidist'] / r['mpi']:11.2f}x")
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"torch_backend-{n}.json")
        with open(path, "w") as f:
            json.dump({"world_size": n, "repeats": args.repeats, "rows": rows}, f, indent=1)
        print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
