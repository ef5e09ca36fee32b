"""Models as sequences of units: an MLP and a GPT-2-style language model.

``model.units`` lists the top-level units in execution order. Running
``x = u.forward(x, ctx)`` over the units equals ``model.forward(x, ctx)``, and running
``dy = u.backward(dy, ctx)`` over them in reverse equals ``model.backward(dy, ctx)``. ZeRO-3
gathers and frees one unit at a time; a pipeline stage owns a contiguous run of units. The
loss is a separate object (:mod:`mpidist.nn.losses`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from mpidist.core.arrays import as_array, to_host

from .attention import Block
from .blas import add_transposed_product
from .layers import Dense, Dropout, Embedding, LayerNorm, ModuleList, matmul_rows, positive_int
from .module import Module

__all__ = ["GPT", "MLP", "GPTConfig", "GPTEmbedding", "GPTHead", "LMHead", "SequentialModel"]


class SequentialModel(Module):
    """A model that runs its :attr:`units` in order. Subclasses set ``self._units``."""

    _units: list[Module]

    @property
    def units(self) -> list[Module]:
        """Top-level units in execution order (each has ``forward`` and ``backward``)."""
        return list(self._units)

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        for unit in self._units:
            x = unit.forward(x, ctx)
        return x

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray | None:
        for unit in reversed(self._units):
            dy = unit.backward(dy, ctx)
        return dy

    def backward_input(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray | None:
        for unit in reversed(self._units):
            dy = unit.backward_input(dy, ctx)
        return dy

    def backward_weight(self, ctx: Hashable = None) -> None:
        for unit in reversed(self._units):
            unit.backward_weight(ctx)


class MLP(SequentialModel):
    """Multi-layer perceptron ``sizes[0] -> sizes[1] -> ... -> sizes[-1]``.

    Each unit is one :class:`~mpidist.nn.layers.Dense` layer (``layers.i.weight``,
    ``layers.i.bias``) with ``activation`` after every layer but the last.
    """

    def __init__(self, sizes: Sequence[int], activation: str = "relu") -> None:
        super().__init__()
        sizes = list(sizes)
        if len(sizes) < 2:
            raise ValueError(f"sizes={sizes} needs at least an input and an output size")
        for i, s in enumerate(sizes):
            positive_int(s, f"sizes[{i}]")
        self.sizes = tuple(int(s) for s in sizes)
        n = len(sizes) - 1
        self.layers = ModuleList(
            Dense(sizes[i], sizes[i + 1], activation if i < n - 1 else None) for i in range(n)
        )
        self._units = list(self.layers)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2-style model.

    Args:
        vocab_size: number of token ids.
        block_size: longest sequence (number of learned positions).
        n_layer, n_head, n_embd: depth, heads, width (``n_embd % n_head == 0``).
        dropout: dropout probability on embeddings (0 keeps runs world-size invariant).
        tie_weights: use the token embedding as the LM head weight (one tensor, one gradient).
        bias: biases in Linear layers.
        layer_norm_eps: LayerNorm epsilon.
    """

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    tie_weights: bool = False
    bias: bool = True
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            positive_int(getattr(self, field), field)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")


class GPTEmbedding(Module):
    """First GPT unit: token ids ``(B, T)`` -> ``wte[ids] + wpe[:T]`` of shape ``(B, T, C)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = Embedding(config.vocab_size, config.n_embd)
        self.wpe = Embedding(config.block_size, config.n_embd)
        self.drop = Dropout(config.dropout) if config.dropout > 0 else None

    def forward(self, idx: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        idx = as_array(idx)
        if idx.ndim != 2:
            raise ValueError(f"token ids of shape {idx.shape} are not (batch, time)")
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(
                f"sequence length {t} exceeds block_size={self.config.block_size}"
            )
        x = self.wte.forward(idx, ctx)
        x += self.wpe.forward(np.arange(t), ctx)
        if self.drop is not None:
            x = self.drop.forward(x, ctx)
        return x

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> None:
        if self.drop is not None:
            dy = self.drop.backward(dy, ctx)
        self.wte.backward(dy, ctx)
        self.wpe.backward(dy.sum(axis=0), ctx)
        return None

    def backward_input(self, dy: np.ndarray, ctx: Hashable = None) -> None:
        if self.drop is not None:
            dy = self.drop.backward_input(dy, ctx)
        self.wte.backward_input(dy, ctx)
        self.wpe.backward_input(dy.sum(axis=0), ctx)
        return None


class LMHead(Module):
    """``logits = x @ weight.T`` with ``weight`` of shape ``(vocab_size, n_embd)``.

    With ``tied_to`` (an :class:`Embedding`) the weight is that embedding's weight: the head
    owns no parameter and its gradient accumulates into the embedding's gradient.
    """

    def __init__(self, n_embd: int, vocab_size: int, tied_to: Embedding | None = None) -> None:
        super().__init__()
        self.n_embd = n_embd
        self.vocab_size = vocab_size
        if tied_to is None:
            self.register_parameter("weight", (vocab_size, n_embd), "normal", 0.02)
        else:
            if (tied_to.num_embeddings, tied_to.embedding_dim) != (vocab_size, n_embd):
                raise ValueError("tied embedding shape does not match (vocab_size, n_embd)")
            self.register_shared("weight", tied_to, "weight")

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        w = self.param("weight")
        if x.shape[-1] != self.n_embd:
            raise ValueError(f"{self.name}: input of shape {x.shape} does not end in {self.n_embd}")
        self._save(ctx, x)
        return matmul_rows(x, w.T)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        self._accumulate(self._take(ctx), dy)
        return matmul_rows(dy, self.param("weight"))

    def backward_input(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        """``dy @ weight``; keeps the input and ``dy`` for :meth:`backward_weight`."""
        x = self._take(ctx)
        dx = matmul_rows(dy, self.param("weight"))
        self._defer(ctx, (x, dy))
        return dx

    def backward_weight(self, ctx: Hashable = None) -> None:
        self._accumulate(*self._take_deferred(ctx))

    def _accumulate(self, x: np.ndarray, dy: np.ndarray) -> None:
        add_transposed_product(self.grad("weight"), dy.reshape(-1, self.vocab_size),
                               x.reshape(-1, self.n_embd))


class GPTHead(Module):
    """Last GPT unit: final LayerNorm ``ln_f`` and the LM head (``(B, T, C) -> (B, T, V)``)."""

    def __init__(self, config: GPTConfig, tied_to: Embedding | None = None) -> None:
        super().__init__()
        self.ln_f = LayerNorm(config.n_embd, config.layer_norm_eps)
        self.head = LMHead(config.n_embd, config.vocab_size, tied_to)

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return self.head.forward(self.ln_f.forward(x, ctx), ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return self.ln_f.backward(self.head.backward(dy, ctx), ctx)

    def backward_input(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return self.ln_f.backward_input(self.head.backward_input(dy, ctx), ctx)


class GPT(SequentialModel):
    """GPT-2-style decoder-only language model.

    Units: ``embed`` (token + learned position embeddings), ``blocks.0`` ... ``blocks.{L-1}``
    (pre-LN transformer blocks), ``final`` (``ln_f`` + LM head). Parameter names are full
    dotted paths, e.g. ``"blocks.0.attn.qkv.weight"``, ``"final.head.weight"``.
    ``forward(idx (B, T) ints) -> logits (B, T, vocab_size)``; ``backward(dlogits)`` returns
    ``None``. With ``config.tie_weights`` the final unit also reads ``"embed.wte.weight"``
    (see :meth:`Module.parameter_names`).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.embed = GPTEmbedding(config)
        self.blocks = ModuleList(
            Block(config.n_embd, config.n_head, config.n_layer, config.bias, config.layer_norm_eps)
            for _ in range(config.n_layer)
        )
        self.final = GPTHead(config, self.embed.wte if config.tie_weights else None)
        self._units = [self.embed, *self.blocks, self.final]

    def generate(
        self,
        idx: np.ndarray,
        max_new_tokens: int,
        temperature: float = 1.0,
        seed: int = 0,
        top_k: int | None = None,
    ) -> np.ndarray:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T); greedy if temperature 0."""
        rng = np.random.default_rng(seed)
        out = np.asarray(idx, dtype=np.int64)
        ctx = ("generate",)
        try:
            for _ in range(int(max_new_tokens)):
                cond = out[:, -self.config.block_size :]
                logits = to_host(self.forward(cond, ctx)[:, -1, :]).astype(np.float64)
                if temperature <= 0:
                    nxt = logits.argmax(axis=-1)
                else:
                    logits = logits / float(temperature)
                    if top_k is not None and top_k < logits.shape[-1]:
                        kth = np.sort(logits, axis=-1)[:, -int(top_k)][:, None]
                        logits = np.where(logits < kth, -np.inf, logits)
                    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
                    p /= p.sum(axis=-1, keepdims=True)
                    nxt = np.array([rng.choice(p.shape[-1], p=row) for row in p])
                out = np.concatenate([out, nxt[:, None].astype(np.int64)], axis=1)
        finally:
            self.clear_cache(ctx, every=False)
        return out
