"""GPT forward+backward throughput: mpidist.nn (NumPy + Numba) next to the same model in PyTorch.

Usage::

    python benchmarks/model_step.py [--threads 1 2] [--steps S] [--n-layer 4 --n-embd 128 ...]

For each thread count (default: 1, then 2), in a fresh process: tokens/s of one
forward+backward (loss included) for mpidist and, when torch is importable, for an identical
PyTorch model with the same weights and the same thread count, timed in alternation; the
ratio; the loss of both (they must agree); and the peak memory of one step above the memory
held before it (activations and temporaries), measured the same way for both (see
:func:`peak_step_bytes`). Then, for the first thread count, a cProfile summary of where
mpidist's time goes. Thread counts must be fixed before NumPy loads its BLAS, which is why
each count runs in its own process.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    p.add_argument(
        "--threads", type=int, nargs="+", default=[1, 2],
        help="BLAS/Numba/torch thread counts, one process each (default: 1 2)",
    )
    p.add_argument("--profile-top", type=int, default=15, help="cProfile rows (0: no profile)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_children(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this script once per thread count, each in a process with its thread variables."""
    import subprocess

    rest, skip = [], False
    for a in argv:  # drop --threads and its values; each child gets one count
        if a == "--threads":
            skip = True
            continue
        if skip and a.lstrip("-").isdigit():
            continue
        skip = False
        rest.append(a)
    rc = 0
    for i, n in enumerate(args.threads):
        env = dict(os.environ)
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                    "NUMBA_NUM_THREADS"):
            env[var] = str(n)
        cmd = [sys.executable, __file__, "--child", "--threads", str(n), *rest]
        if i > 0:
            cmd += ["--profile-top", "0"]
            print()
        sys.stdout.flush()
        rc = rc or subprocess.call(cmd, env=env)
        # Memory in a fresh process whose glibc mmaps every allocation above 64 KiB from the
        # start, so a freed buffer leaves the resident set at once (the default threshold
        # grows and keeps freed memory for reuse); the timings above ran with the defaults.
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        rc = rc or subprocess.call(cmd[:3] + ["--memory"] + cmd[3:], env=env)
    return rc


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and not ARGS.child:
    raise SystemExit(run_children(ARGS, sys.argv[1:]))

import cProfile  # noqa: E402
import gc  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from mpidist.nn import GPT, CrossEntropyLoss, GPTConfig  # noqa: E402


def mpidist_step(model: GPT, loss_fn: CrossEntropyLoss, x: np.ndarray, y: np.ndarray) -> float:
    """One forward+backward; gradients accumulate into the model's gradient buffer."""
    loss = loss_fn.forward(model.forward(x), y)
    model.backward(loss_fn.backward())
    return loss


def time_alternating(steps: list, n: int) -> list[tuple[float, float]]:
    """Median seconds per call and last value of each ``step()``, over ``n`` rounds.

    Each round calls every step once, in alternation, so that load from other processes
    falls on all of them alike; two warm-up rounds come first.
    """
    values = [0.0] * len(steps)
    times: list[list[float]] = [[] for _ in steps]
    for r in range(n + 2):
        for i, step in enumerate(steps):
            t0 = time.perf_counter()
            values[i] = float(step())
            if r >= 2:
                times[i].append(time.perf_counter() - t0)
    return [(float(np.median(t)), v) for t, v in zip(times, values, strict=True)]


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def peak_step_bytes(step) -> int | None:
    """Peak resident memory of one ``step()`` above the resident memory before it.

    The kernel's high-water mark is reset (``/proc/self/clear_refs``) right before the step,
    so the figure covers everything the step allocates and touches, from any allocator
    (NumPy, Numba, torch), with the same instrument for both libraries (after one warm-up
    step; run under ``MALLOC_MMAP_THRESHOLD_=65536``). ``None`` where ``/proc`` does not
    offer this (not Linux).
    """
    try:
        step()
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _proc_status("VmRSS")
        step()
        return _proc_status("VmHWM") - base
    except (OSError, RuntimeError):
        return None


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def torch_gpt(cfg: GPTConfig, params: dict[str, np.ndarray], dtype: str = "float32",
              device: str = "cpu"):
    """The same GPT in PyTorch eager with mpidist's weights copied in: ``(weights,
    forward)``, the parameters by mpidist's names (a tied head shares the embedding's) and
    ``forward(idx) -> logits`` (SDPA attention). Also used by gpu_check_engine.py."""
    import torch
    import torch.nn.functional as F

    tdt = getattr(torch, dtype)
    # mpidist's Linear weights are (in, out); torch's F.linear wants (out, in). Embeddings and
    # the LM head are (rows, n_embd) in both.
    linear = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight")
    w = {name: torch.nn.Parameter(torch.tensor(
        np.ascontiguousarray(a.T if name.endswith(linear) else a), dtype=tdt, device=device))
        for name, a in params.items()}
    if cfg.tie_weights:
        w["final.head.weight"] = w["embed.wte.weight"]
    h, c = cfg.n_head, cfg.n_embd
    eps = cfg.layer_norm_eps

    def forward(idx: torch.Tensor) -> torch.Tensor:
        b, tt = idx.shape
        x = w["embed.wte.weight"][idx] + w["embed.wpe.weight"][:tt]
        for i in range(cfg.n_layer):
            p = f"blocks.{i}."
            a = F.layer_norm(x, (c,), w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
            qkv = F.linear(a, w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"])
            q, k, v = qkv.view(b, tt, 3, h, c // h).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).reshape(b, tt, c)
            x = x + F.linear(y, w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
            a = F.layer_norm(x, (c,), w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
            a = F.linear(a, w[p + "mlp.fc.weight"], w[p + "mlp.fc.bias"])
            a = F.gelu(a, approximate="tanh")
            x = x + F.linear(a, w[p + "mlp.proj.weight"], w[p + "mlp.proj.bias"])
        x = F.layer_norm(x, (c,), w["final.ln_f.weight"], w["final.ln_f.bias"], eps)
        return F.linear(x, w["final.head.weight"])

    return w, forward


def torch_model(cfg: GPTConfig, params: dict[str, np.ndarray], dtype: str, threads: int | None):
    """The same GPT in PyTorch with mpidist's weights copied in; returns a step function."""
    import torch
    import torch.nn.functional as F

    if threads:
        torch.set_num_threads(threads)
    _, forward = torch_gpt(cfg, params, dtype)

    def make_step(x: np.ndarray, y: np.ndarray):
        xi, yi = torch.from_numpy(x), torch.from_numpy(y)

        def step() -> float:
            logits = forward(xi)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yi.reshape(-1))
            loss.backward()
            return float(loss.detach())

        return step

    return make_step, torch.__version__, torch.get_num_threads()


def main(args: argparse.Namespace) -> int:
    cfg = GPTConfig(
        vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
        n_head=args.n_head, n_embd=args.n_embd,
    )
    # As `mpidist train` does; both libraries run in this process under the same setting. The
    # memory child keeps glibc's behaviour set by its MALLOC_MMAP_THRESHOLD_ (see run_children).
    try:
        from mpidist.nn import reuse_freed_memory

        reused = reuse_freed_memory()
    except ImportError:  # a version of mpidist before the setting existed
        reused = False
    model = GPT(cfg)
    dtype = np.dtype(args.dtype)
    params, _ = model.build(dtype=dtype, seed=0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (args.batch, cfg.block_size))
    y = rng.integers(0, cfg.vocab_size, (args.batch, cfg.block_size))
    loss_fn = CrossEntropyLoss()
    tokens = args.batch * cfg.block_size
    threads_n = args.threads[0]
    threads = threads_n
    try:
        from mpidist.nn.fused import get_kernels

        kernels = get_kernels()
    except ImportError:  # a version of mpidist before the setting existed
        kernels = "n/a"

    def mp_step() -> float:
        return mpidist_step(model, loss_fn, x, y)

    try:
        make_step, tv, tthreads = torch_model(cfg, params.views(), args.dtype, threads_n)
    except ImportError:
        make_step = None
    if args.memory:
        mp_mem = peak_step_bytes(mp_step)
        t_mem = None if make_step is None else peak_step_bytes(make_step(x, y))
        ratio = "" if not (mp_mem and t_mem) else f"  ratio {mp_mem / t_mem:.2f}x"
        print(f"peak step memory: mpidist {_mib(mp_mem)}, torch {_mib(t_mem)}{ratio}")
        return 0
    print(f"GPT n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} "
          f"block_size={cfg.block_size} vocab={cfg.vocab_size} batch={args.batch} "
          f"dtype={dtype} params={model.num_parameters():,} threads={threads}")
    print(f"numpy {np.__version__}, python {sys.version.split()[0]}, nn kernels: {kernels}, "
          f"freed memory reused: {'yes' if reused else 'no'}")
    if make_step is None:
        print("torch      : not available (pip install torch to compare); mpidist number only")
        ((sec, loss),) = time_alternating([mp_step], args.steps)
        print(f"mpidist.nn : {sec * 1e3:8.1f} ms/step  {tokens / sec:10.0f} tokens/s  "
              f"loss={loss:.6f}")
    else:
        t_step = make_step(x, y)
        (sec, loss), (tsec, tloss) = time_alternating([mp_step, t_step], args.steps)
        mp_tps, t_tps = tokens / sec, tokens / tsec
        print(f"mpidist.nn : {sec * 1e3:8.1f} ms/step  {mp_tps:10.0f} tokens/s  loss={loss:.6f}")
        print(
            f"torch {tv:<5}: {tsec * 1e3:8.1f} ms/step  {t_tps:10.0f} tokens/s  loss={tloss:.6f}"
            f"  (threads={tthreads})"
        )
        print(
            f"ratio mpidist/torch: {mp_tps / t_tps:.2f}x  "
            f"(loss difference {abs(loss - tloss):.2e})"
        )

    if args.profile_top > 0:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(max(1, args.steps // 2)):
            mpidist_step(model, loss_fn, x, y)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile_top)
        lines = out.getvalue().splitlines()
        start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
        print(f"\ncProfile, top {args.profile_top} functions by own time:")
        print("\n".join(lines[start : start + args.profile_top + 1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(ARGS))
