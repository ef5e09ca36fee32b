"""Causal multi-head self-attention, the GPT-2 MLP block and the pre-LN transformer block."""

from __future__ import annotations

import math
from collections.abc import Hashable

import numpy as np

from .layers import GELU, LayerNorm, Linear, _positive_int
from .module import Module

__all__ = ["Block", "CausalSelfAttention", "FeedForward", "softmax_lastdim"]


def softmax_lastdim(s: np.ndarray) -> np.ndarray:
    """Numerically stable softmax over the last axis, in place on ``s`` (which is returned)."""
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def residual_scale(n_layer: int) -> float:
    """GPT-2's init std for projections that feed the residual stream: 0.02/sqrt(2 n_layer)."""
    return 0.02 / math.sqrt(2 * n_layer)


class CausalSelfAttention(Module):
    """Multi-head self-attention with a causal mask.

    Parameters: ``qkv`` (Linear ``n_embd -> 3 n_embd``, columns ordered q | k | v, each
    head-major) and ``proj`` (Linear ``n_embd -> n_embd``, residual-scaled init).
    Input and output have shape ``(batch, time, n_embd)``.
    """

    def __init__(self, n_embd: int, n_head: int, n_layer: int = 1, bias: bool = True) -> None:
        super().__init__()
        self.n_embd = _positive_int(n_embd, "n_embd")
        self.n_head = _positive_int(n_head, "n_head")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.head_dim = self.n_embd // self.n_head
        self.qkv = Linear(self.n_embd, 3 * self.n_embd, bias)
        self.proj = Linear(self.n_embd, self.n_embd, bias, scale=residual_scale(n_layer))
        self._masks: dict[tuple[int, str], np.ndarray] = {}

    def _mask(self, t: int, dtype: np.dtype) -> np.ndarray:
        key = (t, np.dtype(dtype).str)
        m = self._masks.get(key)
        if m is None:
            # Additive mask: 0 on and below the diagonal, -inf above. Every row keeps its
            # diagonal, so the row max is finite and softmax stays well defined.
            m = np.triu(np.full((t, t), -np.inf, dtype=dtype), k=1)
            self._masks[key] = m
        return m

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        x = np.asarray(x)
        if x.ndim != 3 or x.shape[-1] != self.n_embd:
            raise ValueError(
                f"{self.name}: input of shape {x.shape} is not (batch, time, n_embd={self.n_embd})"
            )
        b, t, c = x.shape
        h, d = self.n_head, self.head_dim
        qkv = self.qkv.forward(x, ctx)
        qkv = qkv.reshape(b, t, 3, h, d).transpose(2, 0, 3, 1, 4)  # (3, B, H, T, D)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = q @ k.transpose(0, 1, 3, 2)
        att *= 1.0 / math.sqrt(d)
        att += self._mask(t, att.dtype)
        softmax_lastdim(att)
        y = att @ v  # (B, H, T, D)
        y = y.transpose(0, 2, 1, 3).reshape(b, t, c)
        self._save(ctx, (q, k, v, att))
        return self.proj.forward(y, ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        q, k, v, att = self._take(ctx)
        b, h, t, d = q.shape
        dyh = self.proj.backward(dy, ctx).reshape(b, t, h, d).transpose(0, 2, 1, 3)
        datt = dyh @ v.transpose(0, 1, 3, 2)  # (B, H, T, T)
        dv = att.transpose(0, 1, 3, 2) @ dyh
        # softmax backward: ds = att * (datt - sum(datt * att)); masked entries have att == 0.
        datt -= np.sum(datt * att, axis=-1, keepdims=True)
        datt *= att
        datt *= 1.0 / math.sqrt(d)
        dq = datt @ k
        dk = datt.transpose(0, 1, 3, 2) @ q
        dqkv = np.stack((dq, dk, dv))  # (3, B, H, T, D)
        dqkv = dqkv.transpose(1, 3, 0, 2, 4).reshape(b, t, 3 * self.n_embd)
        return self.qkv.backward(dqkv, ctx)


class FeedForward(Module):
    """GPT-2 MLP: ``proj(gelu(fc(x)))`` with hidden size ``4 n_embd`` (residual-scaled proj)."""

    def __init__(self, n_embd: int, n_layer: int = 1, bias: bool = True, hidden: int = 0) -> None:
        super().__init__()
        n_embd = _positive_int(n_embd, "n_embd")
        hidden = hidden or 4 * n_embd
        self.fc = Linear(n_embd, hidden, bias)
        self.act = GELU()
        self.proj = Linear(hidden, n_embd, bias, scale=residual_scale(n_layer))

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return self.proj.forward(self.act.forward(self.fc.forward(x, ctx), ctx), ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return self.fc.backward(self.act.backward(self.proj.backward(dy, ctx), ctx), ctx)


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

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        h = x + self.attn.forward(self.ln_1.forward(x, ctx), ctx)
        return h + self.mlp.forward(self.ln_2.forward(h, ctx), ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        dh = dy + self.ln_2.backward(self.mlp.backward(dy, ctx), ctx)
        return dh + self.ln_1.backward(self.attn.backward(dh, ctx), ctx)
