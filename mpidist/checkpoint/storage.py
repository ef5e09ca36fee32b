"""The bytes of a checkpoint file: hyperslab transfers through h5py, the dataset layout
rank 0 creates, and the posix mode's fused checksum-and-``pwrite`` pass with early
writeback, and ``pread``."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from mpidist.checkpoint.agreement import h5py_module
from mpidist.checkpoint.format import (
    ATTR_S1,
    ATTR_S2,
    CorruptCheckpointError,
    Piece,
    TensorInfo,
    checksum_update,
    flat_blocks,
    group_paths,
)

__all__ = ["FUSED_CHUNK_BYTES", "MAX_TRANSFER_BYTES", "POSIX_CHUNK_BYTES", "WRITEBACK_BYTES",
           "Writeback", "create_layout", "dataset_dtype", "file_options", "patch_sums",
           "pread_array", "pwrite_array", "read_chunks", "read_range", "sync_file_range",
           "write_pieces", "write_range", "writeback_bytes"]

#: Largest transfer per HDF5 call, in bytes: bounds temporaries and stays far below the
#: 2 GiB MPI-IO count limit.
MAX_TRANSFER_BYTES = 256 << 20
#: Largest ``os.pread`` call, in bytes (Linux moves at most ~2 GiB per call; smaller calls
#: also bound the conversion temporaries of non-native byte orders).
POSIX_CHUNK_BYTES = 64 << 20
#: Chunk of a save's fused checksum-and-write pass: small enough to stay in cache between
#: the checksum and the copy into the page cache.
FUSED_CHUNK_BYTES = 4 << 20
#: Default early-writeback granularity of a save (``MPIDIST_CHECKPOINT_WRITEBACK_MB``).
WRITEBACK_BYTES = 32 << 20
ATTR_S1_B, ATTR_S2_B = ATTR_S1.encode("ascii"), ATTR_S2.encode("ascii")


def hyperslab(dsid: Any, shape: tuple[int, ...], a: int, b: int) -> tuple[Any, Any]:
    """File and memory dataspaces for flat elements ``[a, b)`` of a dataset."""
    h5s = h5py_module().h5s
    fspace = dsid.get_space()
    if not shape:
        fspace.select_all()
    else:
        op = h5s.SELECT_SET
        for offset, count in flat_blocks(shape, a, b):
            fspace.select_hyperslab(offset, count, op=op)
            op = h5s.SELECT_OR
    return h5s.create_simple((b - a,)), fspace


def transfer_chunks(a: int, b: int, itemsize: int,
                    chunk_bytes: int = MAX_TRANSFER_BYTES) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` ranges of at most ``chunk_bytes`` covering elements ``[a, b)``."""
    step = max(1, chunk_bytes // max(1, itemsize))
    for lo in range(a, b, step):
        yield lo, min(b, lo + step)


def read_chunks(read: Callable[[int, np.ndarray], None], a: int, b: int, dtype: Any,
                chunk_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(start, elements)`` of elements ``[a, b)``, each chunk read by ``read(start, out)``
    into one reused buffer of at most ``chunk_bytes``."""
    dtype = np.dtype(dtype)
    buf = np.empty(min(max(1, chunk_bytes // dtype.itemsize), b - a), dtype=dtype)
    for lo, hi in transfer_chunks(a, b, dtype.itemsize, chunk_bytes):
        read(lo, buf[:hi - lo])
        yield lo, buf[:hi - lo]


def write_range(ds: Any, a: int, data: np.ndarray) -> None:
    shape = tuple(ds.shape)
    data = np.ascontiguousarray(data)
    for lo, hi in transfer_chunks(a, a + data.shape[0], data.dtype.itemsize):
        mspace, fspace = hyperslab(ds.id, shape, lo, hi)
        ds.id.write(mspace, fspace, data[lo - a:hi - a])


def read_range(ds: Any, a: int, out: np.ndarray) -> None:
    shape = tuple(ds.shape)
    for lo, hi in transfer_chunks(a, a + out.shape[0], out.dtype.itemsize):
        mspace, fspace = hyperslab(ds.id, shape, lo, hi)
        ds.id.read(mspace, fspace, out[lo - a:hi - a])


@functools.lru_cache(maxsize=64)
def dataset_dtype(dtype: str) -> np.dtype:
    dt = np.dtype(dtype)
    return dt if dt.itemsize == 1 or dt.kind == "b" else dt.newbyteorder("<")


def file_options(names: Sequence[str], root: Mapping[str, Any]) -> dict[str, Any]:
    """h5py.File options of a new checkpoint: one metadata block for all the metadata.

    HDF5 otherwise allocates each dataset's object header next to its data, scattering
    ~0.5 KB of metadata between the datasets: reading the header of a cold file then costs
    one small random read per dataset, and the data of consecutive datasets is no longer
    one sequential range. A metadata block sized for every header (about 1 KB per object,
    checksum attributes included) puts them together at the start of the file.
    """
    groups = len(group_paths(names))
    attr_bytes = sum(len(str(v)) + len(k) + 64 for k, v in root.items())
    need = 4096 + 1024 * (len(names) + groups) + 2 * attr_bytes
    return {"meta_block_size": min(-(-need // 4096) * 4096, 64 << 20)}


def create_layout(f: Any, names: Sequence[str], infos: Mapping[str, TensorInfo],
                   sums: np.ndarray | None, root: Mapping[str, Any]) -> np.ndarray:
    """Groups, datasets and attributes, in sorted order (collective under mpio).

    Every dataset is contiguous with its space allocated now and never filled, the same in
    every I/O mode. ``sums`` None writes zero checksums, to be filled in by
    :func:`patch_sums`. Returns each dataset's byte offset in the file (int64, in
    ``names`` order; -1 for an empty tensor, which has no storage).
    """
    h5py = h5py_module()
    h5d, h5p, h5s, h5t = h5py.h5d, h5py.h5p, h5py.h5s, h5py.h5t
    for key in sorted(root):
        f.attrs[key] = root[key]
    for g in group_paths(names):
        f.create_group(g)
    # Early allocation fixes each dataset's file offset at creation, so the posix mode can
    # write the bytes without HDF5. Never filling: the pieces overwrite every element, and
    # filling would write the whole file twice. (Built with the low-level API because
    # h5py's create_dataset drops a given property list for scalar datasets.)
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_layout(h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
    dcpl.set_obj_track_times(False)
    # The checksum attributes exactly as ``ds.attrs[k] = np.uint64(v)`` makes them
    # (scalar H5T_STD_U64LE), through the low-level API: h5py's high-level attribute
    # code costs ~0.15 ms per attribute, most of a save's metadata time.
    u64 = h5t.py_create(np.dtype("<u8"), logical=True)
    scalar = h5s.create(h5s.SCALAR)
    types: dict[str, Any] = {}
    offsets = np.full(len(names), -1, dtype=np.int64)
    if sums is None:
        sums = np.zeros((len(names), 2), dtype=np.uint64)
    for t, name in enumerate(names):
        info = infos[name]
        if info.dtype not in types:
            types[info.dtype] = h5t.py_create(dataset_dtype(info.dtype), logical=True)
        space = h5s.create_simple(info.shape) if info.shape else scalar
        dsid = h5d.create(f.id, name.encode("utf-8"), types[info.dtype], space, dcpl=dcpl)
        _write_sums(dsid, sums[t], (u64, scalar))
        offset = dsid.get_offset()
        if offset is not None and info.numel:
            offsets[t] = offset
        dsid.close()
    return offsets


def write_pieces(f: Any, pieces: Sequence[Piece]) -> None:
    for p in pieces:
        if p.data.shape[0]:  # checked by piece_rows: flat is [start, start + len)
            write_range(f[p.name], int(p.flat.start or 0), p.data)


def patch_sums(path: str, names: Sequence[str], sums: np.ndarray) -> None:
    """Overwrite the checksum attributes :func:`create_layout` made as zeros (same size,
    so HDF5 rewrites them in place)."""
    h5py = h5py_module()
    with h5py.File(path, "r+") as f:
        for t, name in enumerate(names):
            dsid = h5py.h5d.open(f.id, name.encode("utf-8"))
            try:
                _write_sums(dsid, sums[t])
            finally:
                dsid.close()


def _write_sums(dsid: Any, row: np.ndarray, create: tuple[Any, Any] | None = None) -> None:
    """The checksum attributes of a dataset: created (with ``(type, space)``) or
    overwritten in place."""
    h5a = h5py_module().h5a
    for key, value in zip((ATTR_S1_B, ATTR_S2_B), row, strict=True):
        aid = h5a.create(dsid, key, *create) if create else h5a.open(dsid, key)
        aid.write(np.array(value, dtype="<u8"))
        aid.close()


@functools.cache
def sync_file_range() -> Any:
    """libc's ``sync_file_range`` where there is one (Linux), else None."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def writeback_bytes() -> int:
    """Early-writeback granularity: ``MPIDIST_CHECKPOINT_WRITEBACK_MB`` (0 turns it off)."""
    mb = os.environ.get("MPIDIST_CHECKPOINT_WRITEBACK_MB", "").strip()
    if not mb:
        return WRITEBACK_BYTES
    try:
        value = float(mb)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"MPIDIST_CHECKPOINT_WRITEBACK_MB={mb!r} must be a number >= 0")
    return int(value * (1 << 20))


class Writeback:
    """Asks the kernel to start writing back each written range of about ``every`` bytes.

    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` only starts the writeback and does not wait
    for it, so the disk works while the next chunks are checksummed and copied, and the
    closing fsync (still the durability point) finds the pages mostly clean. A no-op where
    the call is missing or fails, or with ``MPIDIST_CHECKPOINT_WRITEBACK_MB=0``.
    """

    WRITE = 2  # SYNC_FILE_RANGE_WRITE

    def __init__(self, fd: int, every: int) -> None:
        self.fd, self.every = fd, every
        self.fn = sync_file_range() if every > 0 else None
        self.lo = self.hi = 0

    def wrote(self, lo: int, hi: int) -> None:
        """Note that bytes ``[lo, hi)`` were written; start writeback when enough piled up."""
        if self.fn is None:
            return
        if lo != self.hi:
            self.flush()
            self.lo = lo
        self.hi = hi
        if self.hi - self.lo >= self.every:
            self.flush()

    def flush(self) -> None:
        """Start writeback of what is pending."""
        if self.fn is not None and self.hi > self.lo:
            if self.fn(self.fd, self.lo, self.hi - self.lo, self.WRITE) != 0:
                self.fn = None  # e.g. a file system without it: fsync does all the work
        self.lo = self.hi


def pwrite_array(fd: int, offset: int, data: np.ndarray, stored: np.dtype,
                 writeback: Writeback, sums: tuple[int, int], first: int,
                 chunk_done: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Write ``data`` as ``stored`` (little-endian) bytes at ``offset`` and return ``sums``
    plus its checksum (elements ``first, first+1, ...``), chunk by chunk: each chunk is
    summed while it is in cache, written, and handed to ``writeback``; then
    ``chunk_done(bytes)`` is called, if given (it may raise to stop the write)."""
    step = max(1, FUSED_CHUNK_BYTES // stored.itemsize)
    for lo in range(0, data.shape[0], step):
        # No copy for native little-endian data; converts a big-endian chunk.
        chunk = np.ascontiguousarray(data[lo:lo + step], dtype=stored)
        sums = checksum_update(sums, chunk, first + lo)
        view = memoryview(chunk.view(np.uint8))
        pos = start = offset + lo * stored.itemsize
        while view.nbytes:
            n = os.pwrite(fd, view, pos)
            if n <= 0:
                raise OSError(f"pwrite wrote {n} bytes at offset {pos}")
            view, pos = view[n:], pos + n
        writeback.wrote(start, pos)
        if chunk_done is not None:
            chunk_done(pos - start)
    return sums


def pread_array(fd: int, offset: int, out: np.ndarray, stored: np.dtype, path: str) -> None:
    """Fill ``out`` from the ``stored`` (little-endian) bytes at ``offset``."""
    step = max(1, POSIX_CHUNK_BYTES // stored.itemsize)
    direct = out.dtype == stored  # native little-endian: read straight into ``out``
    for lo in range(0, out.shape[0], step):
        chunk = out[lo:lo + step]
        buf = chunk if direct else np.empty(chunk.shape[0], dtype=stored)
        view = memoryview(buf.view(np.uint8))
        pos = offset + lo * stored.itemsize
        while view.nbytes:
            n = os.preadv(fd, [view], pos)
            if n <= 0:
                raise CorruptCheckpointError(
                    f"{path!r} ends at byte {pos}, inside a dataset (truncated file?)")
            view, pos = view[n:], pos + n
        if not direct:
            chunk[...] = buf
