"""Check ``mpidist plan``'s predictions against measurements on this machine, in one run.

Usage::

    mpiexec -n 2 python benchmarks/plan_check.py
    mpiexec -n 4 python benchmarks/plan_check.py [--n-layer 4 --n-embd 128 ...]

For a small GPT (mpidist.nn, float32, Adam) and the running number of ranks:

* memory: the planner's per-rank model-state bytes (``precision="fp32"``) against
  ``optimizer.memory_report()["total"]`` of DDP, ZeRO-1 and ZeRO-2;
* communication: alpha and beta are calibrated here for each collective (a relative
  least-squares fit at 8 B and at 1/2, 3/4, 3/2 and 2 times, never at, the gradient size;
  ``--factors``), then the planner's alpha-beta cost of each strategy's gradient
  synchronisation (allreduce for DDP/ZeRO-1, reduce-scatter for ZeRO-2) of the model's
  gradient bytes is compared with the measured collective on as many elements as the
  strategy's gradient buffer. Every timed collective, calibration and check alike, runs
  once per round (a new random order each round), right after an untimed call of the same
  collective, on prefixes of one shared buffer, and keeps its best time.

Goal: predictions within 10% of the measurements. Prints a table with the ratios.

Across nodes (the world spans several nodes, e.g. ``jobs/virtual-cluster.sh mpirun -n 4 --
python benchmarks/plan_check.py``), it checks the planner's two network levels instead: the
intra-node link is calibrated by flat allreduces inside each node (all nodes at once), the
node's link by transfers across the nodes run by all of a node's ranks at once (each with
its 1/L of the data, exchanging it with every other node), both at sizes other than the
predicted ones; then
``plan.zero_sync_time`` with ``plan.group_time`` predicts one step's data-parallel
communication of DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (the model as one unit, one micro-batch),
which is compared with the same collectives of mpidist measured on the whole world.
Goal there: within 15%.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=30, help="rounds over every collective")
    p.add_argument("--two-level-repeats", type=int, default=5,
                   help="rounds across nodes (each collective takes ~0.1 s at 1 Gbit/s)")
    p.add_argument("--factors", default="0.5,0.75,1.5,2",
                   help="calibration sizes relative to the gradient size (comma-separated, "
                        "never 1); 8 B is always added")
    return p.parse_args(argv)


ARGS = parse_args()
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpidist.core import collectives as C  # noqa: E402
from mpidist.nn import GPT, GPTConfig  # noqa: E402
from mpidist.optim import Adam  # noqa: E402
from mpidist.parallel import STRATEGIES, ShardingConfiguration  # noqa: E402
from mpidist.parallel import plan as P  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2}


def timed_rounds(calls: dict, rounds: int) -> dict:
    """Best seconds of every call (each the max over ranks), the calls interleaved round by
    round in a new random order, so drifting load on a shared machine hits them alike; the
    minimum is the least disturbed measurement. Each timed call directly follows an
    untimed one of the same collective: what ran before (another size, another collective)
    otherwise decides how much of the buffers and of MPI's shared-memory segments is still
    in cache, which moved the same 13 MB allreduce between 1.7 and 4.5 ms here."""
    best = {k: float("inf") for k in calls}
    order = list(calls)
    rng = np.random.default_rng(0)  # the same order on every rank
    for _ in range(rounds):
        # A new order every round: the call before still leaves some mark on the next
        # (after the warm call too), so no collective always follows the same one.
        for i in rng.permutation(len(order)):
            k, fn = order[i], calls[order[i]]
            fn()
            COMM.Barrier()
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return best


_POOL: dict[str, np.ndarray] = {}


def _pool(name: str, count: int) -> np.ndarray:
    """The first ``count`` elements of one float32 buffer per ``name``, as OSU's benchmarks
    use one buffer for every size: every measured size then sits on the same pages, so
    differences between sizes are the collective's, not where the allocator put each array
    (separate arrays of the same size measured 5-20% apart). Zeros, written once, so
    in-place sums stay zero."""
    buf = _POOL.get(name)
    if buf is None or buf.size < count:
        buf = np.empty(count, dtype=np.float32)
        buf.fill(0.0)
        _POOL[name] = buf
    return buf[:count]


def collective_calls(kind: str, counts: list[int]) -> dict:
    """``{(kind, count): call}`` of ``kind`` on ``count`` float32 elements of the shared
    buffers (:func:`_pool`; allocate the largest first)."""
    calls = {}
    for k in counts:
        buf = _pool("send", k)
        if kind == "allreduce":
            calls[(kind, k)] = lambda b=buf: C.allreduce(b, "sum", comm=COMM)
        else:
            out = _pool("out", k // SIZE)
            calls[(kind, k)] = lambda b=buf, o=out: C.reduce_scatter(b, "sum", comm=COMM,
                                                                      out=o)
    return calls


def fit(kind: str, times: dict[int, float]) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) of ``kind`` under the planner's ring model (allreduce
    ``2(n-1)·alpha + 2(n-1)/n·S/beta``, reduce-scatter ``(n-1)·alpha + (n-1)/n·S/beta``),
    fitted by least squares on the relative error to the measured ``{count: seconds}``.

    Each collective gets its own fit, from 8 B and from sizes around the size being
    predicted (``--factors``, default 1/2, 3/4, 3/2 and 2 times it; never at it), as one
    would measure a link's bandwidth at the message sizes a plan uses: MPI libraries switch
    algorithms with the message size and use different ones per collective (here Open
    MPI's shared-memory reduce-scatter costs more than its allreduce), and on one node the
    effective bandwidth falls in steps as the buffers outgrow the caches (2 ranks here:
    9 GB/s up to 10 MB, 6 GB/s at 13-20 MB, 2.3 GB/s from 40 MB), which one straight
    alpha-beta line cannot follow across. So a pair fitted on small allreduces mispredicts
    a 13 MB reduce-scatter by 2x, and at 2 ranks even this fit is off by up to ~15%."""
    n = SIZE
    rows, ts = [], []
    for k, t in times.items():
        steps = 2 * (n - 1) if kind == "allreduce" else n - 1
        rows.append([steps, steps / n * k * 4])
        ts.append(t)
    w = 1.0 / np.array(ts)
    (alpha, inv_beta), *_ = np.linalg.lstsq(np.array(rows) * w[:, None], np.ones(len(ts)),
                                            rcond=None)
    return max(float(alpha), 0.0), 1.0 / max(float(inv_beta), 1e-15)


def _fit_line(xs: list[float], ts: list[float]) -> tuple[float, float]:
    """(alpha, beta) of ``t = alpha * steps + bytes / beta`` from rows [steps, bytes], fitted
    on the relative error."""
    w = 1.0 / np.array(ts)
    (alpha, inv_beta), *_ = np.linalg.lstsq(np.array(xs) * w[:, None], np.ones(len(ts)),
                                            rcond=None)
    return max(float(alpha), 0.0), 1.0 / max(float(inv_beta), 1e-15)


def _exchange(cross, send: np.ndarray, recv: np.ndarray) -> None:
    """Each rank sends ``send`` to its peer on every other node: the link's load in the
    inter-node step of mpidist's two-level collectives."""
    me, n = cross.Get_rank(), cross.Get_size()
    reqs = []
    for k in range(n):
        if k != me:
            reqs += [cross.Irecv(recv, source=k, tag=7), cross.Isend(send, dest=k, tag=7)]
    # wait as mpidist's collectives do (test, then sleep), leaving the cores to the rest
    while not MPI.Request.Testall(reqs):
        time.sleep(0.0002)


def two_level(args: argparse.Namespace, topo, n_params: int) -> int:
    """The planner's two network levels against mpidist's collectives across nodes."""
    node, cross = topo.subcomms()
    n_local, n_nodes = node.Get_size(), cross.Get_size()
    k_target = -(-n_params // SIZE) * SIZE
    factors = [float(f) for f in args.factors.split(",")]
    cal = [SIZE * 2] + [max(SIZE, int(k_target * f) // SIZE * SIZE) for f in factors]
    _pool("send", 2 * k_target + max(cal))
    _pool("out", max(cal + [k_target]))
    calls = {}
    for k in cal:
        b = _pool("send", k)
        calls[("intra", k)] = lambda b=b: C.allreduce(b, comm=node, algorithm="flat")
        m = max(1, k // SIZE)
        calls[("inter", k)] = lambda m=m: _exchange(cross, _pool("send", m), _pool("out", m))
    g, out = _pool("send", k_target), _pool("out", k_target // SIZE)
    calls[("allreduce", k_target)] = lambda: C.allreduce(g, comm=COMM)
    calls[("reduce_scatter", k_target)] = lambda: C.reduce_scatter(g, comm=COMM, out=out)
    calls[("allgather", k_target)] = lambda: C.allgather(out, comm=COMM, out=g)
    best = timed_rounds(calls, args.two_level_repeats)
    steps_intra = 2 * (n_local - 1)
    a_in, b_in = _fit_line([[steps_intra, steps_intra / n_local * k * 4] for k in cal],
                           [best[("intra", k)] for k in cal])
    # every rank of a node sends m elements to each other node at once
    # (the link's bandwidth from the large sizes only: small TCP messages on a loaded
    # machine wait for the scheduler, and the pipelined collectives only send large ones)
    big = cal[1:]
    a_x, b_node = _fit_line([[1, n_local * (n_nodes - 1) * max(1, k // SIZE) * 4]
                             for k in big], [best[("inter", k)] for k in big])
    cluster = P.Cluster(devices=SIZE, devices_per_node=n_local, intra_bw=b_in,
                        intra_latency=a_in, inter_bw=1e15, inter_latency=a_x,
                        node_bw=b_node)
    nbytes = k_target * 4

    def predicted(kind: str, size: float) -> float:
        return P.group_time(kind, size, SIZE, 1, cluster)

    def measured(kind: str, size: float) -> float:
        return best[(kind, k_target)]

    if RANK == 0:
        print(f"plan_check: {SIZE} ranks on {n_nodes} nodes x {n_local}, GPT "
              f"({n_params / 1e6:.2f} M params, float32 gradients and parameters)")
        print(f"  calibrated intra-node: alpha = {a_in * 1e6:.1f} us, "
              f"beta = {b_in / 1e9:.2f} GB/s; node link: alpha = {a_x * 1e6:.1f} us, "
              f"beta = {b_node / 1e6:.1f} MB/s")
        print(f"{'strategy':<8} {'sync pred ms':>13} {'sync meas ms':>13} {'ratio':>6}  "
              f"within 15%")
        for name, z in (("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3)):
            pt = P.zero_sync_time(z, nbytes, nbytes, 1, predicted)
            mt = P.zero_sync_time(z, nbytes, nbytes, 1, measured)
            ok = abs(pt / mt - 1) <= 0.15
            print(f"{name:<8} {pt * 1e3:13.1f} {mt * 1e3:13.1f} {pt / mt:6.3f}  "
                  f"{'yes' if ok else 'NO'}")
    return 0


def main(args: argparse.Namespace) -> int:
    if SIZE < 2:
        raise ValueError("run under mpiexec -n 2 (or more): communication needs 2 ranks")
    from mpidist.core.topology import topology

    topo = topology(COMM)
    if topo.map.two_level:
        cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size,
                        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
        return two_level(args, topo, GPT(cfg).num_parameters())
    cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size,
                    n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    n_params = GPT(cfg).num_parameters()
    rows = []
    targets = {}
    for name in ("ddp", "zero1", "zero2"):
        opt = STRATEGIES[name](Adam(lr=1e-3), ShardingConfiguration(dtype="float32"))
        model = opt.wrap(GPT(cfg), seed=0)
        measured_mem = COMM.allreduce(opt.memory_report()["total"], op=MPI.MAX)
        predicted_mem = P.model_state_bytes(n_params, precision="fp32", optimizer="adam",
                                            zero_stage=STAGE[name], dp=SIZE)
        targets[name] = model.layout.full_size  # the gradient buffer the strategy syncs
        model.free()
        rows.append([name, predicted_mem, measured_mem])
    # Every collective of the check and of both calibrations, interleaved in rounds.
    k_target = max(1, n_params // SIZE) * SIZE
    factors = [float(f) for f in args.factors.split(",")]
    if not factors or any(f <= 0 or f == 1 for f in factors):
        raise ValueError(f"--factors={args.factors!r}: positive numbers other than 1")
    cal_counts = [SIZE] + [max(SIZE, int(k_target * f) // SIZE * SIZE) for f in factors]
    _pool("send", max(cal_counts + list(targets.values())))
    _pool("out", max(cal_counts + list(targets.values())) // SIZE)
    calls = {}
    for kind in ("allreduce", "reduce_scatter"):
        calls.update(collective_calls(kind, cal_counts))
    for name, full in targets.items():
        kind = "reduce_scatter" if name == "zero2" else "allreduce"
        calls[(name, full)] = collective_calls(kind, [full])[(kind, full)]
    best = timed_rounds(calls, args.repeats)
    fits = {kind: fit(kind, {k: best[(kind, k)] for k in cal_counts})
            for kind in ("allreduce", "reduce_scatter")}
    for row in rows:
        name = row[0]
        if name == "zero2":
            predicted_t = P.reduce_scatter_time(n_params * 4, SIZE, *fits["reduce_scatter"])
        else:
            predicted_t = P.allreduce_time(n_params * 4, SIZE, *fits["allreduce"])
        row += [predicted_t, best[(name, targets[name])]]
    if RANK == 0:
        print(f"plan_check: {SIZE} ranks, GPT L={cfg.n_layer} E={cfg.n_embd} T={cfg.block_size} "
              f"({n_params / 1e6:.2f} M params, float32, Adam)")
        for kind, (alpha, beta) in fits.items():
            print(f"  calibrated {kind}: alpha = {alpha * 1e6:.1f} us, "
                  f"beta = {beta / 1e9:.2f} GB/s")
        print(f"{'strategy':<8} {'mem pred MB':>12} {'mem meas MB':>12} {'ratio':>6} "
              f"{'sync pred ms':>13} {'sync meas ms':>13} {'ratio':>6}  within 10%")
        for name, pm, mm, pt, mt in rows:
            ok = abs(pm / mm - 1) <= 0.10 and abs(pt / mt - 1) <= 0.10
            print(f"{name:<8} {pm / 2**20:12.3f} {mm / 2**20:12.3f} {pm / mm:6.3f} "
                  f"{pt * 1e3:13.3f} {mt * 1e3:13.3f} {pt / mt:6.3f}  {'yes' if ok else 'NO'}")
    return 0


if __name__ == "__main__":
    from mpidist.run.launch import abort_on_failure

    with abort_on_failure():
        sys.exit(main(ARGS))
