"""The checkpoint format: names, metadata, flat-range hyperslabs and the checksum.

Pure (no MPI, no file I/O): the writer, the parallel reader, the serial tools and the tests
share this one definition of ``docs/checkpoint-format.md``. The checksum ("bitsum64")
of a tensor is ``S1 = sum(bits_i)`` and ``S2 = sum((i + 1) * bits_i)`` mod 2**64 over the
little-endian bit patterns of its C-order elements: additive over disjoint ranges, so each
rank sums its own pieces and one integer Allreduce gives the tensor's checksum.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "CHECKSUM_ALGORITHM",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "Piece",
    "TensorInfo",
    "checksum",
    "checksum_update",
    "compare_tensors",
    "flat_blocks",
    "validate_names",
]

FORMAT_NAME = "mpidist-checkpoint"
FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "bitsum64-v1"

#: Root attributes the library writes itself; a caller's ``attrs`` may not use these keys.
RESERVED_ATTRS = frozenset(
    {"format", "format_version", "library_version", "created", "metadata_json",
     "checksum_algorithm", "num_tensors"}
)
#: Per-dataset attributes holding the checksum.
ATTR_S1 = "checksum_s1"
ATTR_S2 = "checksum_s2"

#: Element types a checkpoint may hold (stored little-endian).
SUPPORTED_DTYPES = frozenset(
    np.dtype(t).name
    for t in (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
              np.uint8, np.uint16, np.uint32, np.uint64, np.bool_, np.complex64)
)
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_NAME_PART = re.compile(r"^[^/\x00]+$")


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read as asked; the message names what differs."""


class CorruptCheckpointError(CheckpointError):
    """The file is truncated, unreadable or fails its checksums."""


class CheckpointFormatError(CheckpointError):
    """The file is not an mpidist checkpoint, or has a format version this library can't read."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint holds other tensors (names, shapes or dtypes) than the caller expects."""


@dataclass(frozen=True)
class TensorInfo:
    """Global (unsharded) shape and element type of one named tensor."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"shape={shape} has a negative dimension")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", np.dtype(self.dtype).name)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Piece:
    """Elements ``flat`` (a step-1 slice) of the C-order flattened tensor ``name``.

    For saving, ``data`` holds those elements; for loading, it is the 1-D array they are
    read into.
    """

    name: str
    flat: slice
    data: np.ndarray


def as_tensor_infos(tensors: Mapping[str, Any]) -> dict[str, TensorInfo]:
    """``{name: TensorInfo}`` from TensorInfo values or ``(shape, dtype)`` pairs."""
    out: dict[str, TensorInfo] = {}
    for name, info in tensors.items():
        if not isinstance(info, TensorInfo):
            try:
                shape, dtype = info
            except (TypeError, ValueError):
                raise ValueError(
                    f"tensor {name!r}: {info!r} is neither a TensorInfo nor (shape, dtype)"
                ) from None
            info = TensorInfo(tuple(shape), np.dtype(dtype).name)
        out[name] = info
    return out


def as_piece(item: Any) -> Piece:
    """A :class:`Piece` from a Piece or a ``(name, flat slice, array)`` triple."""
    if isinstance(item, Piece):
        return item
    try:
        name, flat, data = item
    except (TypeError, ValueError):
        raise ValueError(f"{item!r} is neither a Piece nor (name, slice, array)") from None
    return Piece(name, flat, data)


def validate_names(tensors: Mapping[str, TensorInfo]) -> None:
    """Raise ValueError for names HDF5 can't hold as we store them, or unsupported dtypes.

    A name is '/'-separated non-empty parts with no NUL; no tensor name may also be a group
    (a prefix of another name), because a path in HDF5 is either a dataset or a group.
    """
    for name, info in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name {name!r} must be a non-empty string")
        parts = name.split("/")
        if any(not _NAME_PART.match(p) or p in (".", "..") for p in parts):
            raise ValueError(
                f"tensor name {name!r} must be '/'-separated non-empty parts "
                "(no leading, trailing or doubled '/', no '.' or '..' parts)"
            )
        if info.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"tensor {name!r} has dtype {info.dtype!r}; supported: {sorted(SUPPORTED_DTYPES)}"
            )
    clash = sorted(set(group_paths(tensors)) & set(tensors))
    if clash:
        raise ValueError(f"tensor name(s) {clash} are also groups of other tensor names")


def group_paths(names: Iterable[str]) -> list[str]:
    """Every intermediate group of ``names``, parents first, sorted (the creation order)."""
    groups = {"/".join(n.split("/")[:k]) for n in names for k in range(1, n.count("/") + 1)}
    return sorted(groups, key=lambda g: (g.count("/"), g))


def check_flat(name: str, flat: Any, numel: int) -> tuple[int, int]:
    """``(start, stop)`` of a piece's flat slice, validated against the tensor's numel."""
    if not isinstance(flat, slice):
        raise ValueError(f"piece of {name!r}: flat={flat!r} must be a slice")
    if flat.step not in (None, 1):
        raise ValueError(f"piece of {name!r}: flat={flat!r} must have step 1")
    a, b = flat.start, flat.stop
    if a is None:
        a = 0
    if b is None:
        b = numel
    a, b = int(a), int(b)
    if not 0 <= a <= b <= numel:
        raise ValueError(
            f"piece of {name!r}: flat range [{a}, {b}) is outside the tensor's {numel} elements"
        )
    return a, b


def piece_rows(pieces: Sequence[Piece], infos: Mapping[str, TensorInfo],
               index: Mapping[str, int], *, reading: str = "") -> np.ndarray:
    """``(tensor index, start, stop)`` of each piece, after checking it. Not collective.

    Pieces to write carry their data; with ``reading`` (the file's path) they are requests
    whose ``data`` is the writable, contiguous array to read into.
    """
    what, arr = ("request for", "out") if reading else ("piece of", "data")
    rows = np.empty((len(pieces), 3), dtype=np.int64)
    for k, p in enumerate(pieces):
        if p.name not in infos:
            if reading:
                raise CheckpointMismatchError(
                    f"request for tensor {p.name!r}, which {reading!r} does not hold")
            raise ValueError(f"piece names tensor {p.name!r}, which is not in `tensors`")
        info = infos[p.name]
        a, b = check_flat(p.name, p.flat, info.numel)
        data = p.data
        if not isinstance(data, np.ndarray) or data.ndim != 1 or reading and not (
                data.flags.c_contiguous and data.flags.writeable):
            kind = "writable, contiguous 1-D" if reading else "1-D"
            raise ValueError(f"{what} {p.name!r}: {arr} must be a {kind} numpy array")
        if data.shape[0] != b - a:
            raise ValueError(f"{what} {p.name!r}: {arr} has {data.shape[0]} elements for "
                             f"range [{a}, {b})")
        if data.dtype.name != info.dtype:
            differs = "differs from the stored" if reading else "!="
            raise ValueError(f"{what} {p.name!r}: {arr} dtype {data.dtype} {differs} {info.dtype}")
        rows[k] = (index[p.name], a, b)
    return rows


def flat_blocks(shape: tuple[int, ...], start: int,
                stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rectangular blocks ``(offset, count)`` covering flat C-order range ``[start, stop)``.

    The blocks are disjoint and listed in increasing flat order, so visiting them in order
    and each in C order visits the range in order (which is how HDF5 iterates a union of
    hyperslabs). An N-d range needs at most ``2N - 1`` blocks: a partial leading row,
    whole rows, a partial trailing row, recursively.
    """
    if start >= stop:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    rest = shape[1:]

    def row(r: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((r, *o), (1, *c)) for o, c in flat_blocks(rest, a, b)]

    if c0 and r0 == r1:
        return row(r0, c0, c1)
    out = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * len(rest), (r1 - r0, *rest)))
    if c1:
        out += row(r1, 0, c1)
    return out


# -- checksum --------------------------------------------------------------------------------
def _bits(data: np.ndarray) -> np.ndarray:
    """The elements' little-endian bit patterns as unsigned integers of the same width."""
    a = np.ascontiguousarray(data).reshape(-1)
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not _LITTLE):
        a = a.astype(a.dtype.newbyteorder("<"))
    try:
        return a.view(_UINT_OF_SIZE[a.dtype.itemsize])
    except KeyError:
        raise ValueError(f"dtype {a.dtype} (itemsize {a.dtype.itemsize}) has no checksum") from None


_LITTLE = np.little_endian


@functools.cache
def _kernel() -> Any:
    import numba

    @numba.njit(cache=True, nogil=True)
    def sums(bits, w):  # pragma: no cover - compiled
        s1 = np.uint64(0)
        s2 = np.uint64(0)
        one = np.uint64(1)
        for k in range(bits.shape[0]):
            x = np.uint64(bits[k])
            s1 += x
            s2 += w * x
            w += one
        return s1, s2

    return sums


def checksum_update(sums: tuple[int, int], data: np.ndarray, start: int) -> tuple[int, int]:
    """Add the contribution of ``data`` (elements ``start..`` of a tensor) to ``(S1, S2)``."""
    bits = _bits(data)
    if bits.shape[0] == 0:
        return sums
    s1, s2 = _kernel()(bits, np.uint64(start + 1))
    mask = (1 << 64) - 1
    return (sums[0] + int(s1)) & mask, (sums[1] + int(s2)) & mask


def checksum(data: np.ndarray, start: int = 0) -> tuple[int, int]:
    """``(S1, S2)`` of ``data`` taken as elements ``start, start+1, ...`` of a tensor."""
    return checksum_update((0, 0), data, start)


# -- metadata --------------------------------------------------------------------------------
def encode_attrs(attrs: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """Root attributes for the caller's ``attrs`` and the JSON of the whole mapping.

    Scalars (str, int, float, bool) become plain HDF5 attributes; anything else (lists,
    dicts, None) becomes a JSON string attribute under its key, so h5dump shows every value
    and no reader needs an unusual type. ``metadata_json`` holds the whole mapping and is
    what :func:`read_metadata` returns.
    """
    plain: dict[str, Any] = {}
    for key, value in attrs.items():
        if not isinstance(key, str) or not key or "/" in key:
            raise ValueError(f"attribute name {key!r} must be a non-empty string without '/'")
        if key in RESERVED_ATTRS:
            raise ValueError(f"attribute name {key!r} is reserved by the checkpoint format")
        try:
            text = json.dumps(value, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"attribute {key!r}={value!r} is not JSON-serialisable: {exc}") \
                from None
        if isinstance(value, (bool, np.bool_)):
            plain[key] = np.int8(bool(value))  # h5dump reads an int; JSON keeps the bool
        elif isinstance(value, (int, np.integer)):
            plain[key] = np.int64(value)
        elif isinstance(value, (float, np.floating)):
            plain[key] = np.float64(value)
        elif isinstance(value, str):
            plain[key] = value
        else:
            plain[key] = text
    try:
        whole = json.dumps(dict(attrs), sort_keys=True, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"attrs are not JSON-serialisable: {exc}") from None
    return plain, whole


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{value!r} of type {type(value).__name__} is not JSON-serialisable")


def compare_tensors(found: Mapping[str, TensorInfo], expected: Mapping[str, TensorInfo], *,
                    strict: bool = True, limit: int = 20) -> str | None:
    """A message listing how ``found`` differs from ``expected``, or None when they agree.

    ``strict=False`` allows names in ``found`` that ``expected`` lacks (a partial load).
    """
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected)) if strict else []
    wrong = [
        f"{n}: checkpoint has {found[n].shape} {found[n].dtype}, "
        f"expected {expected[n].shape} {expected[n].dtype}"
        for n in sorted(set(found) & set(expected))
        if found[n] != expected[n]
    ]
    if not (missing or unexpected or wrong):
        return None

    def listing(title: str, items: list[str]) -> str:
        more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
        return f"{title} ({len(items)}): " + "; ".join(items[:limit]) + more

    parts = []
    if missing:
        parts.append(listing("missing from the checkpoint", missing))
    if unexpected:
        parts.append(listing("unexpected in the checkpoint", unexpected))
    if wrong:
        parts.append(listing("shape/dtype mismatch", wrong))
    return "checkpoint does not match the expected tensors: " + " | ".join(parts)
