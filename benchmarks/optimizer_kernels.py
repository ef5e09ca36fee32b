"""Fused optimizer kernels against the memory-bandwidth limit, NumPy and torch, in one run.

    python benchmarks/optimizer_kernels.py [--n 16777216] [--repeats 10] [--dtype float32]
                                           [--gpt2-scale 4]

The bandwidth limit is measured in the same run with a STREAM-triad-like Numba kernel
``a[i] = b[i] + s*c[i]`` (12 bytes/element in float32), and the same kernel in place
(``a[i] = a[i] + s*c[i]``): the plain triad also pays a hidden write-allocate read of ``a``
that the optimizer kernels (which read every array they write) do not, so the faster of the
two is taken as the limit. Bytes are counted as 4 (or 8) per
array element read and per element written: Adam/AdamW read p, g, m, v and write p, m, v
(28 bytes/element in float32), SGD with momentum reads p, g, buf and writes p, buf (20).
The NumPy baseline is the same algorithm written with NumPy array operations (unfused: one
pass per operation, temporaries allocated). torch.optim's fused implementations are timed
when torch is importable. Threads: whatever NUMBA_NUM_THREADS says. Single process, not MPI.

With torch, a second table times one step of ``mpidist.torch.optim.AdamW`` on GPT-2 small's
parameter list (148 tensors; widths, vocabulary and context divided by ``--gpt2-scale``)
against ``torch.optim.AdamW(foreach=True)`` and ``fused=True``: the multi-tensor path (one
launch over a flat buffer) with the gradients already in it (``zero_grad(set_to_none=False)``)
and with new gradient tensors every step (``set_to_none=True``: one foreach copy in), and the
per-parameter path (``flat=False``, one launch per tensor).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numba
import numpy as np

import mpidist.optim as optim
from mpidist.optim.kernels import cpu


def interleaved(jobs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best (as STREAM reports) seconds of each job over ``repeats`` rounds, after one
    warm-up call each. Every round times every job once, in an order rotated from round to
    round, so no job is favoured by when it ran (clock, page state, other load): timing the
    kernels one after the other made the same kernel 20-40% slower when it came later."""
    keys = list(jobs)
    for k in keys:
        jobs[k]()
    best = dict.fromkeys(keys, float("inf"))
    for r in range(repeats):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            t0 = time.perf_counter()
            jobs[k]()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def numpy_adam(p, g, m, v, state, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, decoupled=False):
    """Adam/AdamW as separate NumPy operations (what one writes without a fused kernel)."""
    state["step"] += 1
    t = state["step"]
    if decoupled:
        p *= 1 - lr * wd
    elif wd:
        g = g + wd * p
    m *= b1
    m += (1 - b1) * g
    v *= b2
    v += (1 - b2) * g * g
    denom = np.sqrt(v)
    denom /= (1 - b2**t) ** 0.5
    denom += eps
    p -= (lr / (1 - b1**t)) * (m / denom)


def numpy_sgd_momentum(p, g, buf, lr=1e-3, mu=0.9):
    buf *= mu
    buf += g
    p -= lr * buf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16 * 1024 * 1024)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--gpt2-scale", type=int, default=4,
                    help="divide GPT-2 small's widths by this for the parameter-list table")
    args = ap.parse_args()
    dt = np.dtype(args.dtype)
    rng = np.random.default_rng(0)
    p, g = (rng.standard_normal(args.n).astype(dt) for _ in range(2))
    jobs = numpy_jobs(rng, p, g)
    torch_version = torch_jobs(jobs, args.dtype, p, g)
    times = interleaved(jobs, args.repeats)
    print_table(times, args.n, dt, torch_version)
    if torch_version is not None:
        parameter_list(args)


def numpy_jobs(rng: np.random.Generator, p: np.ndarray, g: np.ndarray
               ) -> dict[str, Callable[[], object]]:
    """The stream triads, mpidist's fused updates and the unfused NumPy ones on ``p``,
    ``g``'s size and dtype."""
    n, dt = p.size, p.dtype
    a_, b_, c_ = (rng.standard_normal(n).astype(dt) for _ in range(3))
    half = dt.type(0.5)
    jobs: dict[str, Callable[[], object]] = {}
    jobs["triad"] = lambda: cpu.triad(a_, b_, c_, half)
    # In place (a = a + s*c): the written array is also read, as in the optimizer kernels,
    # so no write-allocate traffic hides behind the 12 counted bytes.
    jobs["triad in place"] = lambda: cpu.triad(a_, a_, c_, half)
    for name, opt in (
        ("adam", optim.Adam()),
        ("adamw", optim.AdamW()),
        ("sgd", optim.SGD(momentum=0.9)),
    ):
        st = opt.init_state(p)
        jobs[name] = lambda opt=opt, st=st: opt.update(p, g, st)
    m, v, buf, np_state = np.zeros(n, dt), np.zeros(n, dt), np.zeros(n, dt), {"step": 0}
    jobs["numpy adam"] = lambda: numpy_adam(p, g, m, v, np_state)
    jobs["numpy adamw"] = lambda: numpy_adam(p, g, m, v, np_state, wd=1e-2, decoupled=True)
    jobs["numpy sgd"] = lambda: numpy_sgd_momentum(p, g, buf)
    return jobs


def torch_jobs(jobs: dict[str, Callable[[], object]], dtype: str, p: np.ndarray,
               g: np.ndarray) -> str | None:
    """Add torch's fused Adam, AdamW and SGD on copies of ``p``, ``g`` to ``jobs``; torch's
    version (None: no torch)."""
    try:
        import torch
    except ImportError:
        return None
    tdt = getattr(torch, dtype)
    tp = torch.nn.Parameter(torch.from_numpy(p.copy()).to(tdt))
    tp.grad = torch.from_numpy(g.copy()).to(tdt)
    for key, make in (
        ("torch adamw", lambda: torch.optim.AdamW([tp], fused=True)),
        ("torch adam", lambda: torch.optim.Adam([tp], fused=True)),
        ("torch sgd", lambda: torch.optim.SGD([tp], lr=1e-3, momentum=0.9, fused=True)),
    ):
        try:
            topt = make()
            topt.step()
            jobs[key] = topt.step
        except (RuntimeError, TypeError, ValueError) as e:  # fused CPU needs torch >= 2.4
            print(f"{key}: not available ({e})")
    return str(torch.__version__)


def print_table(times: dict[str, float], n: int, dt: np.dtype, torch_version: str | None
                ) -> None:
    """Each kernel's time, bandwidth, share of the limit (the faster triad) and speed-up."""
    width = dt.itemsize
    rows: list[tuple[str, float, int, str | None, str | None]] = [  # name, s, bytes, np, torch
        ("stream triad a=b+s*c", times["triad"], 3 * width, None, None),
        ("stream triad in place a=a+s*c", times["triad in place"], 3 * width, None, None)]
    for name, label, nbytes in (
        ("adam", "mpidist Adam (fused)", 7 * width),
        ("adamw", "mpidist AdamW (fused)", 7 * width),
        ("sgd", "mpidist SGD momentum (fused)", 5 * width),
    ):
        rows.append((label, times[name], nbytes, f"numpy {name}", f"torch {name}"))
    for name, nbytes in (("numpy adam", 7), ("numpy adamw", 7), ("numpy sgd", 5)):
        rows.append((f"NumPy {name.split()[1]} (unfused)", times[name], nbytes * width, None, None))
    for name, nbytes in (("torch adam", 7), ("torch adamw", 7), ("torch sgd", 5)):
        if name in times:
            rows.append((f"torch {name.split()[1]} fused=True", times[name], nbytes * width, None,
                         None))
    # The limit is the faster of the two triads (bytes/second as counted above).
    limit = 3 * width * n / min(times["triad"], times["triad in place"])
    print(
        f"n={n} {dt}, NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS}, "
        f"numba {numba.__version__}, numpy {np.__version__}, torch {torch_version or 'absent'}"
    )
    header = f"{'kernel':34s} {'ms':>8s} {'GB/s':>7s} {'% BW':>6s} {'x NumPy':>8s} {'x torch':>8s}"
    print(header)
    print("-" * len(header))
    for label, sec, nbytes, np_key, torch_key in rows:
        gbs = nbytes * n / sec / 1e9
        x_np = f"{times[np_key] / sec:8.2f}" if np_key in times else f"{'-':>8s}"
        x_t = f"{times[torch_key] / sec:8.2f}" if torch_key in times else f"{'-':>8s}"
        pct = 100 * gbs * 1e9 / limit
        print(f"{label:34s} {sec * 1e3:8.2f} {gbs:7.2f} {pct:6.1f} {x_np} {x_t}")


def gpt2_shapes(scale: int) -> list[tuple[int, ...]]:
    """GPT-2 small's 148 parameter shapes with width, vocabulary and context over ``scale``
    (benchmarks/gpu_check.py takes it at scale 1)."""
    d, v, t, layers = 768 // scale, 50257 // scale, 1024 // scale, 12
    shapes: list[tuple[int, ...]] = [(v, d), (t, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,),
                   (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def parameter_list(args: argparse.Namespace) -> None:
    """One AdamW step on GPT-2 small's parameter list: mpidist's multi-tensor and
    per-parameter paths against torch's foreach and fused implementations, interleaved."""
    import torch

    from mpidist.torch.optim import AdamW

    tdt = getattr(torch, args.dtype)
    shapes = gpt2_shapes(args.gpt2_scale)
    torch.manual_seed(0)
    init = [torch.randn(s, dtype=tdt) for s in shapes]
    grads = [torch.randn(s, dtype=tdt) for s in shapes]

    def params() -> list[torch.nn.Parameter]:
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
        return ps

    def new_grads(ps: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> Callable[[], None]:
        def job() -> None:
            for p, g in zip(ps, grads, strict=True):
                p.grad = g
            opt.step()
        return job

    jobs: dict[str, Callable[[], object]] = {
        "torch foreach": torch.optim.AdamW(params(), foreach=True).step,
        "flat": AdamW(params()).step,
        "per-tensor": AdamW(params(), flat=False).step,
    }
    ps = params()
    jobs["flat, new grads"] = new_grads(ps, AdamW(ps))
    try:
        topt = torch.optim.AdamW(params(), fused=True)
        topt.step()
        jobs["torch fused"] = topt.step
    except (RuntimeError, TypeError, ValueError) as e:
        print(f"torch fused: not available ({e})")
    times = interleaved(jobs, args.repeats)
    n = sum(int(np.prod(s)) for s in shapes)
    print(f"\nAdamW step on GPT-2 small's parameter list / {args.gpt2_scale}: "
          f"{len(shapes)} tensors, {n} parameters, {args.dtype}")
    header = f"{'implementation':46s} {'ms':>8s} {'x torch foreach':>16s}"
    print(header)
    print("-" * len(header))
    for key, label in (
        ("flat", "mpidist AdamW multi-tensor (grads in place)"),
        ("flat, new grads", "mpidist AdamW multi-tensor (new grads: +copy)"),
        ("per-tensor", "mpidist AdamW per-tensor (flat=False)"),
        ("torch foreach", "torch AdamW foreach=True"),
        ("torch fused", "torch AdamW fused=True"),
    ):
        if key in times:
            print(f"{label:46s} {times[key] * 1e3:8.2f} "
                  f"{times['torch foreach'] / times[key]:16.2f}")


if __name__ == "__main__":
    main()
