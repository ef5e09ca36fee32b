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

The same run then trains a small GPT (float32, AdamW) on the first layout with DDP, and
with gradient compression (PowerSGD rank 4, fp16) and Local SGD (H = 4), and prints the
training time each needs to reach the validation loss DDP has after ``--train-steps`` steps
(evaluated every 4 steps; the time excludes the evaluations; ``--no-train`` skips it).

With ``--worker`` it is the MPI program itself (one JSON line per measurement on rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "jobs" / "virtual-cluster.sh"
OPS = ("allreduce", "reduce_scatter", "allgather")


# -- the MPI program ----------------------------------------------------------------------
def _calls(comm, op: str, count: int, han: bool) -> dict:
    from mpi4py import MPI

    from mpidist.core import collectives as C

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

    from mpidist.core.topology import topology

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


def _strategies() -> list[tuple[str, Any]]:
    from mpidist.parallel import DDPOptimizer, GradientCompressionOptimizer, LocalSGDOptimizer

    return [
        ("ddp", lambda b, c, l: DDPOptimizer(b, c, loss=l)),
        ("powersgd r=4", lambda b, c, l: GradientCompressionOptimizer(b, c, method="powersgd",
                                                                        rank=4, loss=l)),
        ("fp16", lambda b, c, l: GradientCompressionOptimizer(b, c, method="fp16", loss=l)),
        ("local H=4", lambda b, c, l: LocalSGDOptimizer(b, c, sync_every=4, loss=l)),
    ]


def train_worker(steps: int, chunk: int = 4, batch: int = 16) -> None:
    """Time to DDP's validation loss for each strategy (rank 0 prints JSON lines)."""
    from mpi4py import MPI

    from mpidist.core.mesh import ProcessMesh
    from mpidist.data import TextCorpus
    from mpidist.nn import GPT, CrossEntropyLoss, GPTConfig
    from mpidist.optim import AdamW
    from mpidist.parallel import ShardingConfiguration

    comm = MPI.COMM_WORLD
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=256)
    data, val = TextCorpus(32), TextCorpus(32, split="validation")
    target = None
    for name, make in _strategies():
        mesh = ProcessMesh(comm)
        config = ShardingConfiguration(mesh=mesh, dtype="float32")
        opt = make(AdamW(lr=1e-3, weight_decay=0.1), config, CrossEntropyLoss())
        model = opt.wrap(GPT(cfg), seed=0)
        opt.optimize(model, data, 1, global_batch_size=batch)  # compiles; untimed
        seconds, done, vloss = 0.0, 0, float("nan")
        limit = steps if target is None else 3 * steps
        while done < limit:
            seconds += _time(comm, lambda o=opt, m=model: o.optimize(
                m, data, chunk, global_batch_size=batch))
            done += chunk
            if hasattr(opt, "average_replicas"):
                opt.average_replicas()
            vloss = opt.evaluate(model, val, batches=4, global_batch_size=64)
            if target is not None and vloss <= target:
                break
        reached = target is None or vloss <= target
        if target is None:
            target = vloss
        if comm.Get_rank() == 0:
            print(json.dumps({"train": name, "steps": done, "seconds": seconds,
                              "val_loss": vloss, "target": target, "reached": reached}),
                  flush=True)
        mesh.free()


# -- the driver ---------------------------------------------------------------------------
def bound_seconds(op: str, nbytes: int, n_nodes: int, gbit: float) -> float:
    """Least time the link needs: every node sends (N-1)/N of the data (twice for allreduce)."""
    factor = 2.0 if op == "allreduce" else 1.0
    return factor * nbytes * (n_nodes - 1) / n_nodes / (gbit * 1e9 / 8)


def _cluster_config() -> dict[str, str]:
    state = Path(os.environ.get("MPIDIST_VCLUSTER_DIR",
                                Path(tempfile.gettempdir()) / "mpidist-vcluster"))
    cfg = state / "config"
    if not cfg.exists():
        sys.exit(f"hierarchical.py: no virtual cluster is up ({cfg} missing); "
                 f"run `{CLUSTER} up` first")
    return dict(line.split("=", 1) for line in cfg.read_text().split())


def run_layout(nodes: int, per_node: int, sizes: str, reps: int, han: bool,
               train_steps: int = 0) -> list[dict]:
    cmd = [str(CLUSTER), "mpirun", "-n", str(nodes * per_node), "--ranks-per-node",
           str(per_node)]
    if han:
        cmd += ["--mca", "coll_han_priority", "100"]
    cmd += ["--", sys.executable, str(Path(__file__).resolve()), "--worker",
            "--sizes-mb", sizes, "--reps", str(reps)] + (["--han"] if han else [])
    if train_steps:
        cmd += ["--train-steps", str(train_steps)]
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
    p.add_argument("--han-max-mb", type=float, default=16,
                   help="largest size for HAN (one 64 MiB HAN allreduce took 26-93 s here)")
    p.add_argument("--no-han", action="store_true", help="skip Open MPI's HAN (slow here)")
    p.add_argument("--link-gbit", type=float, default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--train-steps", type=int, default=40,
                   help="DDP's steps in the time-to-loss comparison")
    p.add_argument("--no-train", action="store_true", help="skip the time-to-loss comparison")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--han", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    sizes = [] if a.sizes_mb == "train" else [float(s) for s in a.sizes_mb.split(",")]
    if a.worker:
        if a.sizes_mb == "train":
            train_worker(a.train_steps)
        else:
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
            han_sizes = ",".join(s for s in a.sizes_mb.split(",") if float(s) <= a.han_max_mb)
            if han_sizes:
                rows += run_layout(nn, k, han_sizes, a.han_reps, han=True)
    print(f"# {a.layouts} on the virtual cluster, link {gbit:g} Gbit/s, float32, best of "
          f"{a.reps} (HAN {a.han_reps}); times in ms")
    worst_bound, worst_speed = report(rows, gbit)
    if not a.no_train:
        nn, k = (int(v) for v in a.layouts.split(",")[0].lower().split("x"))
        trained = run_layout(nn, k, "train", 1, han=False, train_steps=a.train_steps)
        rows += trained
        print(f"# time to DDP's validation loss after {a.train_steps} steps, {nn}x{k}, "
              f"GPT 2x256 float32, global batch 16 x 32 tokens, AdamW")
        print(f"{'strategy':>14} {'steps':>6} {'train s':>8} {'val loss':>9} {'vs DDP time':>12}")
        ddp_s = trained[0]["seconds"] if trained else float("nan")
        for r in trained:
            ratio = f"{r['seconds'] / ddp_s:12.2f}" if r["reached"] else f"{'not reached':>12}"
            print(f"{r['train']:>14} {r['steps']:6d} {r['seconds']:8.2f} {r['val_loss']:9.4f} "
                  f"{ratio}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(f"link-bound ratio {worst_bound:.2f}, speed-up over default {worst_speed:.2f}")


if __name__ == "__main__":
    main()
