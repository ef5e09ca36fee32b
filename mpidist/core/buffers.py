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
from typing import Any

import numpy as np

from . import arrays

__all__ = [
    "Bucket",
    "FlatBuffer",
    "ShardedLayout",
    "UnitSpan",
    "make_buckets",
    "TensorSpec",
    "padded_length",
    "row_range",
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


def row_range(rows: int, rank: int, n: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of rank ``rank`` when ``rows`` rows are split over ``n`` ranks the
    way ``torch.chunk`` (and so torch's ``Shard(0)``) splits them: ``shard_size(rows, n)``
    rows each, the last ranks fewer or none, no padding."""
    s = shard_size(rows, n)
    if not 0 <= rank < n:
        raise ValueError(f"rank={rank} is outside a group of size {n}")
    lo = min(rank * s, rows)
    return lo, min(lo + s, rows)


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


def make_buckets(
    specs: Iterable[TensorSpec], total: int, bucket_bytes: int, itemsize: int,
    first_bytes: int | None = None,
) -> list[Bucket]:
    """Contiguous buckets of about ``bucket_bytes`` over a flat range ``[0, total)``.

    Buckets are formed in reverse order of the specs (the order backward produces
    gradients) and never split a tensor; a tensor larger than the bucket size gets a bucket
    of its own. Gaps between tensors (padding) fall into a neighbouring bucket, and the first
    bucket runs to ``total``, so the buckets together cover ``[0, total)`` exactly once.
    ``first_bytes``: a smaller size for the first bucket, so that its communication starts
    early in backward (torch's DDP: 1 MiB).
    """
    _check_group(bucket_bytes, "bucket_bytes")
    if first_bytes is not None:
        _check_group(first_bytes, "first_bytes")
    limit = max(1, bucket_bytes // itemsize)
    first = limit if first_bytes is None else min(limit, max(1, first_bytes // itemsize))
    ordered = sorted(specs, key=lambda sp: sp.offset, reverse=True)
    buckets: list[Bucket] = []
    stop = total
    names: list[str] = []
    start = stop
    for spec in ordered:
        if names and stop - spec.offset > (limit if buckets else first):
            buckets.append(Bucket(len(buckets), start, stop, tuple(names)))
            stop, names = start, []
        names.append(spec.name)
        start = spec.offset
    if names or stop > 0:
        buckets.append(Bucket(len(buckets), 0, stop, tuple(names)))
    return buckets


def _pack(tensors: Iterable[tuple[str, Sequence[int]]]) -> tuple[list[TensorSpec], int]:
    """Specs of the named tensors back to back from offset 0, and their total size;
    ValueError for an empty or repeated name or a negative dimension."""
    specs: dict[str, TensorSpec] = {}
    offset = 0
    for name, shape in tensors:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name {name!r} must be a non-empty string")
        if name in specs:
            raise ValueError(f"tensor name {name!r} is registered twice")
        shape_t = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape_t):
            raise ValueError(f"tensor {name!r} has a negative dimension in shape {shape_t}")
        specs[name] = TensorSpec(name, shape_t, offset)
        offset = specs[name].stop
    return list(specs.values()), offset


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
        device: where to allocate (a :class:`~mpidist.core.arrays.Device`, "cpu" or
            "cuda"); NumPy on the CPU by default. Ignored with ``data``.
    """

    def __init__(
        self,
        tensors: Iterable[tuple[str, Sequence[int]]],
        dtype: np.dtype | type = np.float64,
        *,
        pad_to: int = 1,
        data: np.ndarray | None = None,
        device: Any = None,
    ) -> None:
        _check_group(pad_to, "pad_to")
        specs, self.numel = _pack(tensors)
        self.dtype = np.dtype(dtype)
        self.pad_to = int(pad_to)
        self.specs: dict[str, TensorSpec] = {spec.name: spec for spec in specs}
        length = padded_length(self.numel, self.pad_to)
        if data is None:
            self.data = arrays.device(device).zeros(length, self.dtype)
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
            data=arrays.namespace(self.data).zeros(self.data.shape[0],
                                                   self.dtype if dtype is None else dtype),
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
        self._check_divides(n)
        return shard_range(self.data.shape[0], rank, n)

    def shard(self, rank: int, n: int) -> np.ndarray:
        """Rank ``rank``'s shard as a view of the flat storage."""
        start, stop = self.shard_range(rank, n)
        return self.data[start:stop]

    # -- buckets --------------------------------------------------------------------
    def buckets(self, bucket_bytes: int) -> list[Bucket]:
        """Split the tensors into contiguous buckets of about ``bucket_bytes``.

        See :func:`make_buckets`; the buckets cover the whole allocation, padding included.
        """
        return make_buckets(self.specs.values(), self.data.shape[0], bucket_bytes,
                            self.dtype.itemsize)

    def __repr__(self) -> str:
        return (
            f"FlatBuffer({len(self.specs)} tensors, numel={self.numel}, "
            f"padded={self.data.shape[0]}, dtype={self.dtype})"
        )


@dataclass(frozen=True)
class UnitSpan:
    """One unit of a :class:`ShardedLayout`: its tensors and where its pieces live.

    The unit's tensors are packed from ``full_offset`` in the full buffer and padded to
    ``padded`` elements (a multiple of the group size); rank r's shard of the unit is
    ``[full_offset + r*shard, full_offset + (r+1)*shard)`` of the full buffer and sits at
    ``[local_offset, local_offset + shard)`` of the rank's local shard.
    """

    index: int
    specs: tuple[TensorSpec, ...]  # offsets relative to the unit's start
    numel: int
    padded: int
    shard: int
    full_offset: int
    local_offset: int

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)


class ShardedLayout:
    """The flat layout of a model split into units, each unit sharded over ``n`` ranks.

    The full buffer is the units back to back, each padded to a multiple of ``n``; a rank's
    local shard is its shard of every unit, back to back. Replicated strategies (DDP) use
    the full buffer; ZeRO uses the same layout and keeps only the local shard of what it
    shards, so parameter names, checkpoints and kernels see one map for every strategy.
    With one unit this is exactly a :class:`FlatBuffer` padded to ``n``.

    Pure arithmetic; nothing here allocates large arrays or communicates.

    Args:
        units: for each unit, its ``(name, shape)`` pairs in registration order.
        n: the group size the units are sharded over.
        rank: this rank's index in that group.
    """

    def __init__(self, units: Sequence[Sequence[tuple[str, Sequence[int]]]], n: int,
                 rank: int = 0) -> None:
        _check_group(n)
        if not 0 <= rank < n:
            raise ValueError(f"rank={rank} is outside a group of size {n}")
        self.n, self.rank = int(n), int(rank)
        spans: list[UnitSpan] = []
        seen: set[str] = set()
        full = local = 0
        for u, tensors in enumerate(units):
            specs, off = _pack(tensors)
            for spec in specs:
                if spec.name in seen:
                    raise ValueError(f"tensor name {spec.name!r} appears in two units")
                seen.add(spec.name)
            padded = padded_length(off, n)
            span = UnitSpan(u, tuple(specs), off, padded, padded // n, full, local)
            spans.append(span)
            full += padded
            local += span.shard
        self.units: tuple[UnitSpan, ...] = tuple(spans)
        self.full_size = full
        self.local_size = local
        self.numel = sum(s.numel for s in spans)
        self._where = {spec.name: (span, spec) for span in spans for spec in span.specs}

    @property
    def names(self) -> list[str]:
        """Every tensor name, in layout order."""
        return list(self._where)

    def spec(self, name: str) -> TensorSpec:
        """The tensor's spec with its offset in the full buffer."""
        span, spec = self._where[name]
        return TensorSpec(name, spec.shape, span.full_offset + spec.offset)

    def unit_of(self, name: str) -> int:
        """Index of the unit holding tensor ``name``."""
        return self._where[name][0].index

    def full_views(self, full: np.ndarray) -> dict[str, np.ndarray]:
        """``{name: shaped view}`` of a full-layout array."""
        return {n: full[s.offset:s.stop].reshape(s.shape) for n in self._where
                for s in (self.spec(n),)}

    def unit_views(self, unit: int, buf: np.ndarray) -> dict[str, np.ndarray]:
        """``{name: shaped view}`` of one unit's tensors in a buffer holding just that unit."""
        return {s.name: buf[s.offset:s.stop].reshape(s.shape) for s in self.units[unit].specs}

    def unit_full(self, unit: int, full: np.ndarray) -> np.ndarray:
        """The unit's padded range of a full-layout array."""
        span = self.units[unit]
        return full[span.full_offset:span.full_offset + span.padded]

    def unit_shard_of_full(
        self, unit: int, full: np.ndarray, rank: int | None = None
    ) -> np.ndarray:
        """Rank ``rank``'s (default: this rank's) shard of the unit, inside a full array."""
        span = self.units[unit]
        r = self.rank if rank is None else rank
        start = span.full_offset + r * span.shard
        return full[start:start + span.shard]

    def unit_local(self, unit: int, local: np.ndarray) -> np.ndarray:
        """The unit's piece of a local-shard array."""
        span = self.units[unit]
        return local[span.local_offset:span.local_offset + span.shard]

    def local_pieces(self, rank: int | None = None) -> list[tuple[str, slice, slice]]:
        """``(name, slice of the flattened tensor, slice of the local shard)`` for a rank.

        The map from a rank's local shard back to named global tensors: checkpoints write
        each piece as a hyperslab of the tensor's dataset.
        """
        r = self.rank if rank is None else rank
        out = []
        for span in self.units:
            lo, hi = r * span.shard, (r + 1) * span.shard
            for spec in span.specs:
                a, b = max(lo, spec.offset), min(hi, spec.stop)
                if a < b:
                    out.append((spec.name, slice(a - spec.offset, b - spec.offset),
                                slice(span.local_offset + a - lo, span.local_offset + b - lo)))
        return out

    def buckets(self, bucket_bytes: int, itemsize: int) -> list[Bucket]:
        """Buckets over the full buffer (see :func:`make_buckets`)."""
        return make_buckets((self.spec(n) for n in self._where), self.full_size,
                            bucket_bytes, itemsize)

    def __repr__(self) -> str:
        return (f"ShardedLayout({len(self.units)} units, numel={self.numel}, "
                f"full={self.full_size}, local={self.local_size}, n={self.n})")
