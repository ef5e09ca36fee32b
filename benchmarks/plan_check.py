"""Check ``mpidist plan``'s predictions against measurements on this machine, in one run.

Usage::

    mpiexec -n 2 python benchmarks/plan_check.py
    mpiexec -n 4 python benchmarks/plan_check.py [--n-layer 4 --n-embd 128 ...]

For a small GPT (mpidist.nn, float32, Adam) and the running number of ranks:

* memory: the planner's per-rank model-state bytes (``precision="fp32"``) against
  ``optimizer.memory_report()["total"]`` of DDP, ZeRO-1 and ZeRO-2;
* communication: alpha and beta are calibrated here (a least-squares fit of allreduces of
  8 B to 8 MiB), then the planner's alpha-beta cost of each strategy's
  gradient synchronisation (allreduce for DDP/ZeRO-1, reduce-scatter for ZeRO-2) of the
  model's gradient bytes is compared with the measured collective.

Goal: predictions within 10% of the measurements. Prints a table with the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    return p.parse_args(argv)


ARGS = parse_args()
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpidist import collectives as C  # noqa: E402
from mpidist import plan as P  # noqa: E402
from mpidist.nn import GPT, GPTConfig  # noqa: E402
from mpidist.optim import Adam  # noqa: E402
from mpidist.parallel import STRATEGIES, ShardingConfiguration  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2}


def timed(fn, repeats: int) -> float:
    """Median seconds over ``repeats`` calls (each the max over ranks), after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        COMM.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return statistics.median(times)


def calibrate(repeats: int) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) of this machine's allreduce under the ring model
    ``T = 2(n-1)·alpha + 2(n-1)/n·S/beta``, fitted by least squares to allreduces of
    8 B to 8 MiB (the regime of the gradient buffers checked here)."""
    n = SIZE
    sizes = [2, 2**16, 2**18, 2**20, 2**21]  # float32 elements: 8 B ... 8 MiB
    xs, ts = [], []
    for k in sizes:
        buf = np.zeros(k, dtype=np.float32)
        ts.append(timed(lambda b=buf: C.allreduce(b, "sum", comm=COMM), repeats))
        xs.append(buf.nbytes)
    a_mat = np.array([[2 * (n - 1), 2 * (n - 1) / n * x] for x in xs])
    (alpha, inv_beta), *_ = np.linalg.lstsq(a_mat, np.array(ts), rcond=None)
    return max(float(alpha), 0.0), 1.0 / max(float(inv_beta), 1e-15)


def main(args: argparse.Namespace) -> int:
    if SIZE < 2:
        raise ValueError("run under mpiexec -n 2 (or more): communication needs 2 ranks")
    cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size,
                    n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    n_params = GPT(cfg).num_parameters()
    alpha, beta = calibrate(args.repeats)
    rows = []
    for name in ("ddp", "zero1", "zero2"):
        opt = STRATEGIES[name](Adam(lr=1e-3), ShardingConfiguration(dtype="float32"))
        model = opt.wrap(GPT(cfg), seed=0)
        measured_mem = COMM.allreduce(opt.memory_report()["total"], op=MPI.MAX)
        predicted_mem = P.model_state_bytes(n_params, precision="fp32", optimizer="adam",
                                            zero_stage=STAGE[name], dp=SIZE)
        full = model.layout.full_size
        grads = np.zeros(full, dtype=np.float32)
        if name == "zero2":
            out = np.empty(full // SIZE, dtype=np.float32)
            measured_t = timed(lambda g=grads, o=out: C.reduce_scatter(g, "sum", comm=COMM,
                                                                       out=o), args.repeats)
            predicted_t = P.reduce_scatter_time(n_params * 4, SIZE, alpha, beta)
        else:
            measured_t = timed(lambda g=grads: C.allreduce(g, "sum", comm=COMM), args.repeats)
            predicted_t = P.allreduce_time(n_params * 4, SIZE, alpha, beta)
        model.free()
        rows.append((name, predicted_mem, measured_mem, predicted_t, measured_t))
    if RANK == 0:
        print(f"plan_check: {SIZE} ranks, GPT L={cfg.n_layer} E={cfg.n_embd} T={cfg.block_size} "
              f"({n_params / 1e6:.2f} M params, float32, Adam); calibrated alpha = "
              f"{alpha * 1e6:.1f} us, beta = {beta / 1e9:.2f} GB/s")
        print(f"{'strategy':<8} {'mem pred MB':>12} {'mem meas MB':>12} {'ratio':>6} "
              f"{'sync pred ms':>13} {'sync meas ms':>13} {'ratio':>6}  within 10%")
        for name, pm, mm, pt, mt in rows:
            ok = abs(pm / mm - 1) <= 0.10 and abs(pt / mt - 1) <= 0.10
            print(f"{name:<8} {pm / 2**20:12.3f} {mm / 2**20:12.3f} {pm / mm:6.3f} "
                  f"{pt * 1e3:13.3f} {mt * 1e3:13.3f} {pt / mt:6.3f}  {'yes' if ok else 'NO'}")
    return 0


if __name__ == "__main__":
    from mpidist.launch import abort_on_failure

    with abort_on_failure():
        sys.exit(main(ARGS))
