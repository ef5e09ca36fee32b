"""Flat parameter and gradient storage: one contiguous array, named views, shards, buckets.

Every parameter of a model lives in one contiguous 1-D array per dtype and each parameter
is a view into it; gradients use a second buffer with the same layout. Sharding over a group
of size N pads the buffer to a multiple of N and gives rank r the slice ``[r*s, (r+1)*s)``,
so collectives run with equal counts. Buckets are contiguous ranges in reverse registration
order, so the bucket that backward fills first is reduced first.

Nothing here communicates.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Bucket",
    "FlatBuffer",
    "TensorSpec",
    "padded_length",
    "shard_range",
    "shard_size",
]

Shape = tuple[int, ...]


def _check_group(n: int, what: str = "group size") -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{what}={n!r} must be a positive integer")


def shard_size(numel: int, n: int) -> int:
    """Elements per rank when ``numel`` elements are split, with padding, over ``n`` ranks."""
    _check_group(n)
    if numel < 0:
        raise ValueError(f"numel={numel} must be >= 0")
    return -(-numel // n)


def padded_length(numel: int, n: int) -> int:
    """``numel`` rounded up to a multiple of ``n``."""
    return shard_size(numel, n) * n


def shard_range(numel: int, rank: int, n: int) -> tuple[int, int]:
    """Range ``[start, stop)`` of rank ``rank`` in the padded buffer of ``numel`` elements."""
    s = shard_size(numel, n)
    if not 0 <= rank < n:
        raise ValueError(f"rank={rank} is outside a group of size {n}")
    return rank * s, (rank + 1) * s


@dataclass(frozen=True)
class TensorSpec:
    """Where one named tensor lives in a flat buffer."""

    name: str
    shape: Shape
    offset: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def stop(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class Bucket:
    """A contiguous range ``[start, stop)`` of a flat buffer and the tensors inside it."""

    index: int
    start: int
    stop: int
    names: tuple[str, ...]

    @property
    def size(self) -> int:
        return self.stop - self.start


def _normalize_specs(tensors: Iterable[tuple[str, Sequence[int]]]) -> list[tuple[str, Shape]]:
    out: list[tuple[str, Shape]] = []
    seen: set[str] = set()
    for item in tensors:
        name, shape = item
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name {name!r} must be a non-empty string")
        if name in seen:
            raise ValueError(f"tensor name {name!r} is registered twice")
        seen.add(name)
        shape_t = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape_t):
            raise ValueError(f"tensor {name!r} has a negative dimension in shape {shape_t}")
        out.append((name, shape_t))
    return out


class FlatBuffer:
    """Named tensors of one dtype stored back to back in one contiguous 1-D array.

    ``FlatBuffer([("w", (3, 4)), ("b", (4,))], np.float64, pad_to=3)`` allocates
    ``padded_length(16, 3) == 18`` zeros; ``buf["w"]`` is a (3, 4) view of the first 12.
    The padding tail stays zero unless a caller writes there; kernels may update it
    harmlessly because it never maps to a tensor.

    Args:
        tensors: ``(name, shape)`` pairs in registration order.
        dtype: element type of the whole buffer.
        pad_to: the allocation is rounded up to a multiple of this (a group size).
        data: an existing 1-D array to use as storage instead of allocating
            (length at least the padded length); the buffer then views it.
    """

    def __init__(
        self,
        tensors: Iterable[tuple[str, Sequence[int]]],
        dtype: np.dtype | type = np.float64,
        *,
        pad_to: int = 1,
        data: np.ndarray | None = None,
    ) -> None:
        _check_group(pad_to, "pad_to")
        specs = _normalize_specs(tensors)
        self.dtype = np.dtype(dtype)
        self.pad_to = int(pad_to)
        self.specs: dict[str, TensorSpec] = {}
        offset = 0
        for name, shape in specs:
            spec = TensorSpec(name, shape, offset)
            self.specs[name] = spec
            offset = spec.stop
        self.numel = offset
        length = padded_length(self.numel, self.pad_to)
        if data is None:
            self.data = np.zeros(length, dtype=self.dtype)
        else:
            if data.ndim != 1 or data.shape[0] < length:
                raise ValueError(
                    f"storage of shape {data.shape} is too small for {length} elements"
                )
            if data.dtype != self.dtype:
                raise ValueError(f"storage dtype {data.dtype} differs from {self.dtype}")
            self.data = data[:length]

    # -- layout ---------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Tensor names in registration order."""
        return list(self.specs)

    @property
    def nbytes(self) -> int:
        """Bytes of the allocation, padding included."""
        return int(self.data.nbytes)

    def __len__(self) -> int:
        return len(self.specs)

    def __contains__(self, name: object) -> bool:
        return name in self.specs

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.view(name)

    def view(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a shaped view into the flat storage (no copy)."""
        try:
            spec = self.specs[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in this buffer") from None
        return self.data[spec.offset : spec.stop].reshape(spec.shape)

    def views(self) -> dict[str, np.ndarray]:
        """All tensors as ``{name: view}`` in registration order."""
        return {name: self.view(name) for name in self.specs}

    def like(self, dtype: np.dtype | type | None = None) -> FlatBuffer:
        """A zeroed buffer with the same names, shapes and padding (e.g. for gradients)."""
        return FlatBuffer(
            [(s.name, s.shape) for s in self.specs.values()],
            self.dtype if dtype is None else dtype,
            pad_to=self.pad_to,
        )

    def zero_(self) -> None:
        """Set every element, padding included, to zero."""
        self.data.fill(0)

    # -- sharding -------------------------------------------------------------------
    def _check_divides(self, n: int) -> None:
        _check_group(n)
        if self.data.shape[0] % n:
            raise ValueError(
                f"buffer of {self.data.shape[0]} elements (pad_to={self.pad_to}) "
                f"cannot be sharded over {n} ranks; build it with pad_to={n}"
            )

    def shard_size(self, n: int) -> int:
        """Elements per rank when the padded buffer is split over ``n`` ranks."""
        self._check_divides(n)
        return self.data.shape[0] // n

    def shard_range(self, rank: int, n: int) -> tuple[int, int]:
        """``[start, stop)`` of rank ``rank``'s shard over a group of ``n``."""
        s = self.shard_size(n)
        if not 0 <= rank < n:
            raise ValueError(f"rank={rank} is outside a group of size {n}")
        return rank * s, (rank + 1) * s

    def shard(self, rank: int, n: int) -> np.ndarray:
        """Rank ``rank``'s shard as a view of the flat storage."""
        start, stop = self.shard_range(rank, n)
        return self.data[start:stop]

    def tensor_slices(self, start: int, stop: int) -> list[tuple[str, slice, slice]]:
        """Tensors overlapping the flat range ``[start, stop)``.

        Returns ``(name, flat_slice_in_tensor, slice_in_range)`` for each overlap, in order,
        so a shard can be mapped back to the named tensors it covers (checkpoints use this).
        """
        out = []
        for spec in self.specs.values():
            lo, hi = max(start, spec.offset), min(stop, spec.stop)
            if lo < hi:
                in_tensor = slice(lo - spec.offset, hi - spec.offset)
                out.append((spec.name, in_tensor, slice(lo - start, hi - start)))
        return out

    # -- buckets --------------------------------------------------------------------
    def buckets(self, bucket_bytes: int) -> list[Bucket]:
        """Split the tensors into contiguous buckets of about ``bucket_bytes``.

        Buckets are formed in reverse registration order (the order backward produces
        gradients) and never split a tensor; a tensor larger than the bucket size gets a
        bucket of its own. The first bucket (the last-registered tensors) also covers the
        padding tail, so the buckets together cover the whole allocation exactly once.
        """
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)):
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be an integer")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
        limit = max(1, bucket_bytes // self.dtype.itemsize)
        specs = list(self.specs.values())[::-1]
        buckets: list[Bucket] = []
        stop = self.data.shape[0]
        names: list[str] = []
        start = stop
        for spec in specs:
            if names and stop - spec.offset > limit:
                buckets.append(Bucket(len(buckets), start, stop, tuple(names)))
                stop, names = start, []
            names.append(spec.name)
            start = spec.offset
        if names or stop > 0:
            buckets.append(Bucket(len(buckets), 0, stop, tuple(names)))
        return buckets

    def __repr__(self) -> str:
        return (
            f"FlatBuffer({len(self.specs)} tensors, numel={self.numel}, "
            f"padded={self.data.shape[0]}, dtype={self.dtype})"
        )
