"""GPT forward+backward throughput: mpidist.nn (NumPy) next to the same model in PyTorch (CPU).

Usage::

    python benchmarks/model_step.py [--threads N] [--steps S] [--n-layer 4 --n-embd 128 ...]

Prints tokens/s of one forward+backward (loss included) for mpidist and, when torch is
importable, for an identical PyTorch model with the same weights and the same thread count,
the ratio, and the loss of both (they must agree). Then a cProfile summary of where
mpidist's time goes. Thread counts must be fixed before NumPy loads its BLAS, so arguments are
parsed before anything imports NumPy.
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
        "--threads",
        type=int,
        default=int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or None,
        help="BLAS/torch threads (default: OMP_NUM_THREADS, else the library default)",
    )
    p.add_argument("--profile-top", type=int, default=15, help="cProfile rows (0: no profile)")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.threads:
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)

import cProfile  # noqa: E402
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


def time_steps(step, n: int) -> tuple[float, float]:
    """Median seconds per call of ``step()`` over ``n`` calls after 2 warm-up calls; last value."""
    value = 0.0
    for _ in range(2):
        value = step()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        value = step()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), float(value)


def torch_model(cfg: GPTConfig, params: dict[str, np.ndarray], dtype: str, threads: int | None):
    """The same GPT in PyTorch with mpidist's weights copied in; returns a step function."""
    import torch
    import torch.nn.functional as F

    if threads:
        torch.set_num_threads(threads)
    tdt = getattr(torch, dtype)

    def t(name: str, transpose: bool = False) -> torch.Tensor:
        a = params[name].T if transpose else params[name]
        return torch.nn.Parameter(torch.tensor(np.ascontiguousarray(a), dtype=tdt))

    # mpidist's Linear weights are (in, out); torch's F.linear wants (out, in). Embeddings and
    # the LM head are (rows, n_embd) in both.
    linear = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight")
    w = {name: t(name, transpose=name.endswith(linear)) for name in params}
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

    def make_step(x: np.ndarray, y: np.ndarray):
        xi, yi = torch.from_numpy(x), torch.from_numpy(y)

        def step() -> float:
            logits = forward(xi)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yi.reshape(-1))
            loss.backward()
            return float(loss)

        return step

    return make_step, torch.__version__, torch.get_num_threads()


def main(args: argparse.Namespace) -> int:
    cfg = GPTConfig(
        vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
        n_head=args.n_head, n_embd=args.n_embd,
    )
    model = GPT(cfg)
    dtype = np.dtype(args.dtype)
    params, _ = model.build(dtype=dtype, seed=0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (args.batch, cfg.block_size))
    y = rng.integers(0, cfg.vocab_size, (args.batch, cfg.block_size))
    loss_fn = CrossEntropyLoss()
    tokens = args.batch * cfg.block_size
    threads = args.threads or "library default"
    print(
        f"GPT n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} "
        f"block_size={cfg.block_size} vocab={cfg.vocab_size} batch={args.batch} "
        f"dtype={dtype} params={model.num_parameters():,} threads={threads}"
    )
    print(f"numpy {np.__version__}, python {sys.version.split()[0]}")

    sec, loss = time_steps(lambda: mpidist_step(model, loss_fn, x, y), args.steps)
    mp_tps = tokens / sec
    print(f"mpidist.nn : {sec * 1e3:8.1f} ms/step  {mp_tps:10.0f} tokens/s  loss={loss:.6f}")

    try:
        make_step, tv, tthreads = torch_model(cfg, params.views(), args.dtype, args.threads)
    except ImportError:
        print("torch      : not available (pip install torch to compare); mpidist number only")
    else:
        tsec, tloss = time_steps(make_step(x, y), args.steps)
        t_tps = tokens / tsec
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
