"""Shared fixtures-as-functions for the checkpoint tests (not a test module)."""

from __future__ import annotations

import numpy as np

from mpidist.checkpoint import Piece, TensorInfo
from mpidist.core.buffers import ShardedLayout

# Odd sizes on purpose: shards never line up with rows.
UNITS = [
    [("emb.weight", (13, 7)), ("emb.bias", (5,))],
    [("blocks.0.attn.qkv.weight", (11, 3, 5)), ("blocks.0.scale", ())],
    [("blocks.1.mlp.w", (9, 17)), ("blocks.1.mlp.b", (17,)), ("head.w", (3, 1, 2, 7))],
]
STATES = ["params", "optimizer/exp_avg", "optimizer/exp_avg_sq"]


def model_tensors(dtype: str = "float32") -> dict[str, TensorInfo]:
    return {f"{g}/{n}": TensorInfo(s, dtype) for g in STATES for u in UNITS for n, s in u}


def full_values(seed: int = 0, dtype: str = "float32") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(i.shape).astype(dtype)
            for n, i in model_tensors(dtype).items()}


def sharded_pieces(values: dict[str, np.ndarray], n: int, rank: int) -> list[Piece]:
    """The pieces a ZeRO-like strategy on ``n`` ranks would hand to save_checkpoint."""
    pieces = []
    for g in STATES:
        units = [[(f"{g}/{name}", shape) for name, shape in u] for u in UNITS]
        layout = ShardedLayout(units, n, rank)
        local = np.zeros(layout.local_size, dtype=np.float32)
        for name, flat, loc in layout.local_pieces():
            local[loc] = values[name].ravel()[flat]
        pieces += [Piece(name, flat, local[loc]) for name, flat, loc in layout.local_pieces()]
    return pieces


def empty_requests(n: int, rank: int, dtype: str = "float32") -> list[Piece]:
    """Requests for the pieces rank ``rank`` of an ``n``-rank layout needs, into new arrays."""
    return [Piece(p.name, p.flat, np.full(p.data.shape, np.nan, dtype=dtype))
            for p in sharded_pieces(full_values(), n, rank)]


def all_requests(dtype: str = "float32") -> list[Piece]:
    return [Piece(n, slice(0, i.numel), np.empty(i.numel, dtype=dtype))
            for n, i in model_tensors(dtype).items()]
