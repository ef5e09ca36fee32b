"""Run on the virtual cluster: two-level collectives equal the flat ones; mesh placement.

    jobs/virtual-cluster.sh mpirun -n 4 [--map-by node] -- python tests/cluster/collectives_job.py

Rank 0 prints one JSON line with what it checked; any mismatch raises (and aborts the job).
"""

from __future__ import annotations

import json

import numpy as np
from mpi4py import MPI

from mpidist.core import collectives as C
from mpidist.core.mesh import ProcessMesh
from mpidist.core.topology import topology


def check_collectives(comm) -> int:
    """Every size (odd ones, pieces of the pipeline) and dtype: hierarchical == flat."""
    n, r = comm.Get_size(), comm.Get_rank()
    checked = 0
    for count in (1, 5, 1001, 300_007):
        for dtype in (np.float64, np.float32, np.int64):
            rng = np.random.default_rng(1000 * r + count)
            x = (rng.standard_normal(count) * 100).astype(dtype)
            exact = np.dtype(dtype).kind == "i"
            # a float sum in another order differs by a few ulps of the largest summand
            big = comm.allreduce(float(np.abs(x).max()), op=MPI.MAX)
            eps = np.finfo(dtype).eps if not exact else 0.0
            tol = {"rtol": 0.0, "atol": 4 * n * eps * big}
            for op in ("sum", "avg", "max", "min"):
                a = C.allreduce(x.copy(), op, comm=comm, algorithm="flat")
                b = C.allreduce(x.copy(), op, comm=comm, algorithm="hierarchical")
                req = C.iallreduce(x.copy(), op, comm=comm, algorithm="hierarchical")
                c = req.wait()
                if exact or op in ("max", "min"):
                    assert np.array_equal(a, b) and np.array_equal(b, c), (count, dtype, op)
                else:
                    assert np.allclose(a, b, **tol) and np.array_equal(b, c), (count, dtype, op)
                # every rank holds the very same result
                everyone = np.empty((n, count), dtype=dtype)
                comm.Allgather(b, everyone)
                assert (everyone == b).all(), (count, dtype, op)
            a = C.reduce_scatter(x, comm=comm, algorithm="flat")
            b = C.reduce_scatter(x, comm=comm, algorithm="hierarchical")
            assert np.array_equal(a, b) if exact else np.allclose(a, b, **tol), (count, dtype)
            a = C.allgather(x, comm=comm, algorithm="flat")
            b = C.allgather(x, comm=comm, algorithm="hierarchical")
            assert np.array_equal(a, b), (count, dtype)
            buf = np.zeros(count * n, dtype=dtype)
            buf[r * count:(r + 1) * count] = x
            C.allgather_inplace(buf, comm=comm, algorithm="hierarchical")
            assert np.array_equal(buf, a), (count, dtype)
            checked += 1
    return checked


def check_placement(comm) -> dict:
    """tp groups inside one node, whatever order the launcher gave the ranks."""
    host = MPI.Get_processor_name()
    mesh = ProcessMesh(comm, tp=2)
    tp_hosts = mesh.group("tp").allgather(host)
    assert len(set(tp_hosts)) == 1, f"tp group spans {tp_hosts}"
    lines = mesh.describe_nodes()
    mesh.free()
    return {"tp_hosts": tp_hosts, "layout": lines}


def main() -> None:
    comm = MPI.COMM_WORLD
    nodes = topology(comm).map
    checked = check_collectives(comm)
    placement = check_placement(comm)
    world_hosts = comm.allgather(MPI.Get_processor_name())
    if comm.Get_rank() == 0:
        print(json.dumps({"nodes": nodes.n_nodes, "two_level": nodes.two_level,
                          "checked": checked, "world_hosts": world_hosts, **placement}))


if __name__ == "__main__":
    main()
