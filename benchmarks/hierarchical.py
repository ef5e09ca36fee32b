"""Collectives across nodes: Open MPI's default, its HAN component and mpidist's, against the link.

    jobs/virtual-cluster.sh up --nodes 2 --ranks-per-node 4 --link-gbit 1
    python benchmarks/hierarchical.py [--layouts 2x2,2x4] [--sizes-mb 1,16,64] [--json FILE]
    jobs/virtual-cluster.sh down

The driver runs this file as MPI jobs on the virtual cluster (``jobs/virtual-cluster.sh
mpirun``), one per layout (nodes x ranks per node) for Open MPI's default collectives and
mpidist's (alternating in every repetition, same buffers), and one more per layout with
Open MPI's HAN component given the top priority (``--mca coll_han_priority 100``). It times
float32 allreduce, reduce_scatter and allgather of 1, 16 and 64 MiB (the full vector: the
allreduce buffer, the reduce-scatter input, the allgather output); a repetition's time is
the slowest rank's and the table gives the best of the repetitions.

The link bound is the time the inter-node link needs for the bytes every node must send
(and receive) at least: ``(N-1)/N * S`` for reduce-scatter and allgather, twice that for
allreduce, at the link's rate (``--link-gbit``, default the cluster's). The last line reads
``link-bound ratio X.XX, speed-up over default Y.YY``: the worst mpidist / bound and the
worst default / mpidist over the layouts, operations and sizes of 16 MiB and more (goals:
<= 1.10 and >= 1.2).

With ``--worker`` it is the MPI program itself (one JSON line per measurement on rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "jobs" / "virtual-cluster.sh"
OPS = ("allreduce", "reduce_scatter", "allgather")


# -- the MPI program ----------------------------------------------------------------------
def _calls(comm, op: str, count: int, han: bool) -> dict:
    from mpi4py import MPI

    from mpidist import collectives as C

    n = comm.Get_size()
    x = np.random.default_rng(comm.Get_rank()).standard_normal(count).astype(np.float32)
    shard = np.ascontiguousarray(x[: count // n])
    out_shard = np.empty(count // n, dtype=np.float32)
    full = np.empty(count, dtype=np.float32)
    calls = {
        # out of place: Open MPI 4.1.4's HAN crashes on a large in-place allreduce
        "allreduce": (lambda: comm.Allreduce(x, full, op=MPI.SUM),
                      lambda: C.allreduce(x, "sum", comm=comm)),
        "reduce_scatter": (lambda: comm.Reduce_scatter_block(x, out_shard, op=MPI.SUM),
                           lambda: C.reduce_scatter(x, "sum", comm=comm, out=out_shard)),
        "allgather": (lambda: comm.Allgather(shard, full),
                      lambda: C.allgather(shard, comm=comm, out=full)),
    }
    raw, ours = calls[op]
    return {"han": raw} if han else {"default": raw, "mpidist": ours}


def _time(comm, fn) -> float:
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    dt = np.array([time.perf_counter() - t0])
    comm.Allreduce(MPI.IN_PLACE, dt, op=MPI.MAX)
    return float(dt[0])


def worker(sizes_mb: list[float], reps: int, han: bool) -> None:
    from mpi4py import MPI

    from mpidist.topology import topology

    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    nodes = topology(comm).map
    for mb in sizes_mb:
        count = max(n, int(mb * 2**20) // 4 // n * n)
        for op in OPS:
            fns = _calls(comm, op, count, han)
            for fn in fns.values():  # warm up (and build the sub-communicators)
                fn()
            best = {k: float("inf") for k in fns}
            for i in range(reps):
                names = list(fns) if i % 2 == 0 else list(fns)[::-1]
                for k in names:
                    best[k] = min(best[k], _time(comm, fns[k]))
            if comm.Get_rank() == 0:
                for k, t in best.items():
                    print(json.dumps({"impl": k, "op": op, "bytes": count * 4, "seconds": t,
                                      "nodes": nodes.n_nodes, "ranks": n}), flush=True)


# -- the driver ---------------------------------------------------------------------------
def bound_seconds(op: str, nbytes: int, n_nodes: int, gbit: float) -> float:
    """Least time the link needs: every node sends (N-1)/N of the data (twice for allreduce)."""
    factor = 2.0 if op == "allreduce" else 1.0
    return factor * nbytes * (n_nodes - 1) / n_nodes / (gbit * 1e9 / 8)


def _cluster_config() -> dict[str, str]:
    state = Path(os.environ.get("MPIDIST_VCLUSTER_DIR",
                                Path(os.environ.get("TMPDIR", "/tmp")) / "mpidist-vcluster"))
    cfg = state / "config"
    if not cfg.exists():
        sys.exit(f"hierarchical.py: no virtual cluster is up ({cfg} missing); "
                 f"run `{CLUSTER} up` first")
    return dict(line.split("=", 1) for line in cfg.read_text().split())


def run_layout(nodes: int, per_node: int, sizes: str, reps: int, han: bool) -> list[dict]:
    cmd = [str(CLUSTER), "mpirun", "-n", str(nodes * per_node), "--ranks-per-node",
           str(per_node)]
    if han:
        cmd += ["--mca", "coll_han_priority", "100"]
    cmd += ["--", sys.executable, str(Path(__file__).resolve()), "--worker",
            "--sizes-mb", sizes, "--reps", str(reps)] + (["--han"] if han else [])
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        msg = (f"hierarchical.py: {' '.join(cmd)} failed ({res.returncode}):\n"
               f"{res.stdout[-1500:]}{res.stderr[-1500:]}")
        if not han:
            sys.exit(msg)
        print(msg.splitlines()[0], file=sys.stderr)  # HAN's own failure: report, go on
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def report(rows: list[dict], gbit: float) -> tuple[float, float]:
    table: dict[tuple, dict[str, float]] = {}
    for r in rows:
        key = (r["nodes"], r["ranks"] // r["nodes"], r["op"], r["bytes"])
        table.setdefault(key, {})[r["impl"]] = r["seconds"]
    print(f"{'layout':>7} {'op':>15} {'MiB':>5} {'bound ms':>9} {'default':>9} {'HAN':>9} "
          f"{'mpidist':>9} {'mpidist/bound':>13} {'default/mpidist':>15}")
    worst_bound, worst_speed = 0.0, float("inf")
    for (nn, k, op, nbytes), t in sorted(table.items()):
        b = bound_seconds(op, nbytes, nn, gbit)
        ratio, speed = t["mpidist"] / b, t["default"] / t["mpidist"]
        han = f"{t['han'] * 1e3:9.1f}" if "han" in t else f"{'-':>9}"
        print(f"{nn}x{k:<5} {op:>15} {nbytes / 2**20:5.0f} {b * 1e3:9.1f} "
              f"{t['default'] * 1e3:9.1f} {han} {t['mpidist'] * 1e3:9.1f} {ratio:13.2f} "
              f"{speed:15.2f}")
        if nbytes >= 16 * 2**20:
            worst_bound, worst_speed = max(worst_bound, ratio), min(worst_speed, speed)
    return worst_bound, worst_speed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default="2x2,2x4", help="nodes x ranks per node, comma-separated")
    p.add_argument("--sizes-mb", default="1,16,64")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--han-reps", type=int, default=2)
    p.add_argument("--no-han", action="store_true", help="skip Open MPI's HAN (slow here)")
    p.add_argument("--link-gbit", type=float, default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--han", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    sizes = [float(s) for s in a.sizes_mb.split(",")]
    if a.worker:
        worker(sizes, a.reps, a.han)
        return
    cfg = _cluster_config()
    gbit = a.link_gbit if a.link_gbit is not None else float(cfg.get("link_gbit", "1"))
    if gbit <= 0:
        sys.exit("hierarchical.py: the cluster's link is unlimited; give --link-gbit")
    rows: list[dict] = []
    for layout in a.layouts.split(","):
        nn, k = (int(v) for v in layout.lower().split("x"))
        if nn > int(cfg["nodes"]):
            sys.exit(f"hierarchical.py: layout {layout} needs {nn} nodes; the cluster has "
                     f"{cfg['nodes']}")
        rows += run_layout(nn, k, a.sizes_mb, a.reps, han=False)
        if not a.no_han:
            rows += run_layout(nn, k, a.sizes_mb, a.han_reps, han=True)
    print(f"# {a.layouts} on the virtual cluster, link {gbit:g} Gbit/s, float32, best of "
          f"{a.reps} (HAN {a.han_reps}); times in ms")
    worst_bound, worst_speed = report(rows, gbit)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(f"link-bound ratio {worst_bound:.2f}, speed-up over default {worst_speed:.2f}")


if __name__ == "__main__":
    main()
