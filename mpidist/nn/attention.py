"""Causal multi-head self-attention, the GPT-2 MLP block and the pre-LN transformer block."""

from __future__ import annotations

import math
from collections.abc import Hashable

import numpy as np

from mpidist.core.arrays import as_array, namespace

from . import fused as F
from .layers import GELU, LayerNorm, Linear, positive_int
from .module import Module

__all__ = [
    "Block",
    "CausalSelfAttention",
    "FeedForward",
    "causal_attention",
    "causal_attention_backward",
    "keeps_probabilities",
    "softmax_lastdim",
]


def softmax_lastdim(s: np.ndarray) -> np.ndarray:
    """Numerically stable softmax over the last axis, in place on ``s`` (which is returned)."""
    s -= s.max(axis=-1, keepdims=True)
    namespace(s).exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def residual_scale(n_layer: int) -> float:
    """GPT-2's init std for projections that feed the residual stream: 0.02/sqrt(2 n_layer)."""
    return 0.02 / math.sqrt(2 * n_layer)


def _heads(a: np.ndarray, i: int) -> np.ndarray:
    """View (B, H, T, D) of block ``i`` (q, k or v) of ``a`` shaped (B, T, 3, H, D)."""
    return a[:, :, i].transpose(0, 2, 1, 3)


# The causal products skip the blocks above the diagonal: the rows are cut into up to
# _MAX_BLOCKS blocks of at least _MIN_ROWS rows, and block i of the scores is computed only
# against keys [0, end of block i). Four blocks compute 5/8 of the full products (two: 3/4);
# more, smaller products cost more than they save.
_MIN_ROWS = 32
_MAX_BLOCKS = 4


def _edges(t: int, host: bool = True) -> list[int]:
    n = max(1, min(_MAX_BLOCKS, t // _MIN_ROWS)) if host else 1  # a GPU: one product
    return [t * i // n for i in range(n + 1)]


def _lower_product(a: np.ndarray, b: np.ndarray, out: np.ndarray, edges: list[int]) -> None:
    """``out = a @ b`` for a causal (T, T) result: row block ``i`` only against columns
    ``[0, edges[i + 1])``; the rest of the block (above the diagonal) is left as it was, for
    the softmax functions, which never read there and write zeros."""
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        _product(a[..., lo:hi, :], b[..., :, :hi], out, (Ellipsis, slice(lo, hi), slice(0, hi)))


def _lower_left(p: np.ndarray, b: np.ndarray, out: np.ndarray, edges: list[int]) -> None:
    """``out = p @ b`` for a lower-triangular ``p`` (..., T, T): row block ``i`` of ``p`` is
    zero from column ``edges[i + 1]`` on."""
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        _product(p[..., lo:hi, :hi], b[..., :hi, :], out, (Ellipsis, slice(lo, hi), slice(None)))


def _lower_left_t(p: np.ndarray, b: np.ndarray, out: np.ndarray, edges: list[int]) -> None:
    """``out = p^T @ b`` for a lower-triangular ``p`` (..., T, T): column block ``i`` of
    ``p`` is zero above row ``edges[i]``."""
    pt = p.transpose(0, 1, 3, 2)
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        _product(pt[..., lo:hi, lo:], b[..., lo:, :], out, (Ellipsis, slice(lo, hi), slice(None)))


def _product(a: np.ndarray, b: np.ndarray, out: np.ndarray, where: tuple) -> None:
    """``out[where] = a @ b``: into the view itself with NumPy, and on a device where the
    view is contiguous; else through a new product (cuBLAS writes contiguous arrays)."""
    target = out[where]
    if isinstance(out, np.ndarray) or target.flags.c_contiguous:
        namespace(out).matmul(a, b, out=target)
    else:
        out[where] = namespace(out).matmul(a, b)


def keeps_probabilities(t: int, head_dim: int) -> bool:
    """Whether :func:`causal_attention` keeps its T x T probabilities for backward: where they
    are no larger than the MLP's hidden activation (H T against 4 H D numbers per token,
    so T <= 4 D), whose GELU output :class:`FeedForward` recomputes instead of keeping.
    Longer sequences keep one log-sum-exp per score row and recompute the probabilities."""
    return t <= 4 * head_dim


def causal_attention(qkv: np.ndarray, n_head: int, *,
                     keep_probabilities: bool | None = None) -> tuple[np.ndarray, tuple]:
    """Causal softmax attention of ``qkv`` (B, T, 3 H D; columns q | k | v, head-major).

    Returns the output (B, T, H D) and what :func:`causal_attention_backward` needs: ``qkv``
    and either the probabilities P (B, H, T, T), which spares backward one of the seven
    matrix products and the exponentials, or each score row's log-sum-exp (B, H, T).
    ``keep_probabilities`` chooses; ``None`` keeps P where :func:`keeps_probabilities` says.
    The output is written head by head straight into its (B, T, H, D) layout, so no
    transpose is copied. Not collective.
    """
    b, t, c3 = qkv.shape
    d = c3 // (3 * n_head)
    if keep_probabilities is None:
        keep_probabilities = keeps_probabilities(t, d)
    if F.attention_kernel_applies(qkv):
        y, kept = F.attention_forward(qkv, n_head, 1.0 / math.sqrt(d), keep_probabilities)
        return y, (qkv.reshape(b, t, 3, n_head, d), kept)
    xp = namespace(qkv)
    edges = _edges(t, xp is np)
    a = qkv.reshape(b, t, 3, n_head, d)
    q, k, v = _heads(a, 0), _heads(a, 1), _heads(a, 2)
    s = xp.empty((b, n_head, t, t), dtype=a.dtype)
    _lower_product(q, k.transpose(0, 1, 3, 2), s, edges)
    lse = F.causal_softmax(s, 1.0 / math.sqrt(d))
    y = xp.empty((b, t, n_head, d), dtype=s.dtype)
    _lower_left(s, v, y.transpose(0, 2, 1, 3), edges)
    return y.reshape(b, t, n_head * d), (a, s if keep_probabilities else lse)


def causal_attention_backward(dy: np.ndarray, saved: tuple) -> np.ndarray:
    """Gradient of :func:`causal_attention`'s ``qkv`` from that of its output ``dy``
    (B, T, H D), written block by block into one (B, T, 3 H D) array. Not collective."""
    a, kept = saved
    b, t, _, h, d = a.shape
    scale = 1.0 / math.sqrt(d)
    if F.attention_kernel_applies(a, dy, kept):
        return F.attention_backward(dy, a.reshape(b, t, 3 * h * d), kept, h, scale)
    xp = namespace(a)
    edges = _edges(t, xp is np)
    q, k, v = _heads(a, 0), _heads(a, 1), _heads(a, 2)
    if kept.ndim == 4:
        p = kept
    else:  # log-sum-exp only: the scores again, and the probabilities from them
        p = xp.empty((b, h, t, t), dtype=a.dtype)
        _lower_product(q, k.transpose(0, 1, 3, 2), p, edges)
        F.causal_softmax_recompute(p, kept, scale)
    dyh = dy.reshape(b, t, h, d).transpose(0, 2, 1, 3)
    dp = xp.empty((b, h, t, t), dtype=dy.dtype)
    _lower_product(dyh, v.transpose(0, 1, 3, 2), dp, edges)
    F.causal_softmax_backward(p, dp, scale)  # dp <- dS
    da = xp.empty(a.shape, dtype=dp.dtype)
    _lower_left(dp, k, _heads(da, 0), edges)
    _lower_left_t(dp, q, _heads(da, 1), edges)
    _lower_left_t(p, dyh, _heads(da, 2), edges)
    return da.reshape(b, t, 3 * h * d)


class CausalSelfAttention(Module):
    """Multi-head self-attention with a causal mask.

    Parameters: ``qkv`` (Linear ``n_embd -> 3 n_embd``, columns ordered q | k | v, each
    head-major) and ``proj`` (Linear ``n_embd -> n_embd``, residual-scaled init).
    Input and output have shape ``(batch, time, n_embd)``.
    """

    def __init__(self, n_embd: int, n_head: int, n_layer: int = 1, bias: bool = True) -> None:
        super().__init__()
        self.n_embd = positive_int(n_embd, "n_embd")
        self.n_head = positive_int(n_head, "n_head")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.head_dim = self.n_embd // self.n_head
        self.qkv = Linear(self.n_embd, 3 * self.n_embd, bias)
        self.proj = Linear(self.n_embd, self.n_embd, bias, scale=residual_scale(n_layer))

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        x = as_array(x)
        if x.ndim != 3 or x.shape[-1] != self.n_embd:
            raise ValueError(
                f"{self.name}: input of shape {x.shape} is not (batch, time, n_embd={self.n_embd})"
            )
        y, saved = causal_attention(self.qkv.forward(x, ctx), self.n_head)
        self._save(ctx, saved)
        return self.proj.forward(y, ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        saved = self._take(ctx)
        return self.qkv.backward(causal_attention_backward(self.proj.backward(dy, ctx), saved),
                                 ctx)

    def backward_input(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        """The input gradient; the projections keep their inputs and output gradients for
        :meth:`backward_weight` (the attention's own saved tensors are dropped here)."""
        saved = self._take(ctx)
        da = causal_attention_backward(self.proj.backward_input(dy, ctx), saved)
        del saved
        return self.qkv.backward_input(da, ctx)


class FeedForward(Module):
    """GPT-2 MLP: ``proj(gelu(fc(x)))`` with hidden size ``4 n_embd`` (residual-scaled proj).

    Keeps for backward the fc output but not the GELU output: backward recomputes that in
    the pass that applies GELU's derivative (which computes the same sigmoid anyway). That
    makes room for the attention's probabilities (:func:`keeps_probabilities`)."""

    def __init__(self, n_embd: int, n_layer: int = 1, bias: bool = True, hidden: int = 0) -> None:
        super().__init__()
        n_embd = positive_int(n_embd, "n_embd")
        hidden = hidden or 4 * n_embd
        self.fc = Linear(n_embd, hidden, bias)
        self.act = GELU()
        self.proj = Linear(hidden, n_embd, bias, scale=residual_scale(n_layer))

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        # The fc bias is added inside the GELU kernel (one pass instead of two).
        h = self.fc.forward(x, ctx, add_bias=False)
        bias = self.fc.param("bias") if self.fc.has_bias else None
        return self.proj.forward(self.act.forward(h, ctx, bias=bias), ctx, keep_input=False)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        bias_grad = self.fc.grad("bias") if self.fc.has_bias else None
        dh, a = self.act.backward_output(self.proj.input_grad(dy), ctx, bias_grad=bias_grad,
                                         overwrite=True)
        self.proj.accumulate_grad(a, dy)
        del a
        return self.fc.backward(dh, ctx, bias_grad=False)

    def backward_input(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        """The input gradient. The GELU output that ``proj``'s weight gradient needs comes
        out of the derivative's pass (as in :meth:`backward`) and is kept in place of the
        pre-activation it was computed from; the fc bias gradient, which :meth:`backward`
        sums in that pass, is left to ``fc``'s :meth:`~Linear.backward_weight` (the same sum
        of the same array)."""
        dh, a = self.act.backward_output(self.proj.input_grad(dy), ctx, overwrite=True)
        self.proj.defer_grad(ctx, a, dy)
        del a
        return self.fc.backward_input(dh, ctx)


class Block(Module):
    """Pre-LN transformer block: ``x + attn(ln_1(x))`` then ``h + mlp(ln_2(h))``."""

    def __init__(
        self, n_embd: int, n_head: int, n_layer: int = 1, bias: bool = True, eps: float = 1e-5
    ) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(n_embd, eps)
        self.attn = CausalSelfAttention(n_embd, n_head, n_layer, bias)
        self.ln_2 = LayerNorm(n_embd, eps)
        self.mlp = FeedForward(n_embd, n_layer, bias)

    # The residual adds go into the branch's result, a new array nobody else holds, rather
    # than into yet another new array.
    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        h = self.attn.forward(self.ln_1.forward(x, ctx), ctx)
        h += x
        out = self.mlp.forward(self.ln_2.forward(h, ctx), ctx)
        out += h
        return out

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        dh = self.ln_2.backward(self.mlp.backward(dy, ctx), ctx)
        dh += dy
        dx = self.ln_1.backward(self.attn.backward(dh, ctx), ctx)
        dx += dh
        return dx

    def backward_input(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        dh = self.ln_2.backward_input(self.mlp.backward_input(dy, ctx), ctx)
        dh += dy
        dx = self.ln_1.backward_input(self.attn.backward_input(dh, ctx), ctx)
        dx += dh
        return dx
