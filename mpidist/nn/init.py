"""Deterministic parameter initialisation.

A parameter's initial values depend only on ``(seed, name)`` and the recipe (kind, scale),
never on the rank, the mesh or the order modules were built in. Any rank can therefore make
any slice of any parameter on its own: tensor-parallel layers call :func:`init_slice`, ZeRO
ranks call :func:`init_value` for the tensors overlapping their shard.

Values are drawn in float64 and then cast, so a float32 model starts from the float64 model's
values rounded to float32.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

__all__ = ["INIT_KINDS", "init_generator", "init_slice", "init_value", "name_words"]

INIT_KINDS = ("normal", "uniform", "zeros", "ones", "constant")


def name_words(name: str) -> list[int]:
    """Four 32-bit words of the BLAKE2b digest of ``name`` (stable across runs and platforms)."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=16).digest()
    return [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]


def init_generator(name: str, seed: int) -> np.random.Generator:
    """The random generator of parameter ``name`` under ``seed``."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative integer")
    return np.random.default_rng(np.random.SeedSequence([int(seed), *name_words(name)]))


def init_value(
    name: str,
    shape: Sequence[int],
    seed: int,
    kind: str = "normal",
    dtype: np.dtype | type = np.float64,
    *,
    scale: float = 1.0,
) -> np.ndarray:
    """The full initial tensor of parameter ``name``.

    Args:
        name: full dotted parameter name, e.g. ``"blocks.0.attn.qkv.weight"``.
        shape: the parameter's full (unsharded) shape.
        seed: run seed (non-negative integer).
        kind: ``"normal"`` (std ``scale``), ``"uniform"`` (in ``[-scale, scale)``),
            ``"zeros"``, ``"ones"`` or ``"constant"`` (every element ``scale``).
        dtype: element type of the result.
        scale: standard deviation, half-width or constant, depending on ``kind``.
    """
    shape_t = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape_t):
        raise ValueError(f"shape={shape_t} of {name!r} has a negative dimension")
    if kind == "zeros":
        return np.zeros(shape_t, dtype=dtype)
    if kind == "ones":
        return np.ones(shape_t, dtype=dtype)
    if kind == "constant":
        return np.full(shape_t, scale, dtype=dtype)
    rng = init_generator(name, seed)
    if kind == "normal":
        out = rng.standard_normal(shape_t) * float(scale)
    elif kind == "uniform":
        out = rng.uniform(-float(scale), float(scale), size=shape_t)
    else:
        raise ValueError(f"init kind={kind!r} is not one of {INIT_KINDS}")
    return out.astype(dtype, copy=False)


def init_slice(
    name: str,
    shape: Sequence[int],
    index: tuple[slice | int, ...] | slice,
    seed: int,
    kind: str = "normal",
    dtype: np.dtype | type = np.float64,
    *,
    scale: float = 1.0,
) -> np.ndarray:
    """``init_value(name, shape, ...)[index]`` — the same values whoever asks for them.

    The full tensor is generated and sliced: simple and exact, and the models here are small
    enough for that to cost nothing next to a training step.
    """
    full = init_value(name, shape, seed, kind, dtype, scale=scale)
    return np.ascontiguousarray(full[index])


def fan_in_bound(fan_in: int) -> float:
    """Half-width ``1/sqrt(fan_in)`` of the uniform init of dense layers."""
    return 1.0 / math.sqrt(max(1, int(fan_in)))
