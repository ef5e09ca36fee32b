"""Collective save and load of checkpoints: one HDF5 file, atomic commit, verified reads.

A checkpoint is one HDF5 file of global named tensors (``docs/checkpoint-format.md``).
Every rank writes the pieces it owns as hyperslabs of the tensors' datasets and reads back
whatever pieces it asks for, so a checkpoint written by N ranks with one sharding loads on
M ranks with any other.

The file is an ordinary HDF5 file whichever way it is written; the I/O modes differ only
in how the bytes get there. Chosen identically on every rank (``serial=`` argument, else
``MPIDIST_CHECKPOINT_SERIAL=1``, else ``MPIDIST_CHECKPOINT_IO=posix|mpio|serial``):

* ``posix`` (default): rank 0 alone creates the file with h5py's default (sec2) driver:
  every group, attribute and dataset, the datasets contiguous with their space allocated
  at creation (``H5D_ALLOC_TIME_EARLY``) and never filled, so each dataset's byte offset
  is fixed before any data exists; the checksum attributes are written as zeros. Rank 0
  closes the file and broadcasts the offsets; every rank then checksums and
  ``os.pwrite``s its pieces' little-endian bytes at ``offset + start * itemsize`` chunk by
  chunk, starting the kernel's writeback as it goes (``sync_file_range`` on Linux,
  ``MPIDIST_CHECKPOINT_WRITEBACK_MB``); the sums are combined with one Allreduce, rank 0
  overwrites the zero checksums in place, and every rank fsyncs. Loading is the reverse:
  rank 0 reads the header and offsets, and every rank ``os.pread``s its ranges. Datasets
  that are not plainly contiguous (files written by other tools: chunked, filtered, other
  byte order) are read through h5py.
  Why the default: HDF5 adds nothing to the data transfers of contiguous datasets, while
  opening and closing a file with the ``mpio`` driver (collective metadata, MPI-IO
  file-view setup, a collective truncate) cost seconds per checkpoint; see
  ``benchmarks/checkpoint_io.py``.
* ``mpio``: ``h5py`` built with MPI and a communicator of more than one rank (otherwise
  ``posix``). The file is opened with ``driver="mpio"``; file, group, dataset and
  attribute creation are collective (every rank makes the same calls in the same, sorted,
  order); piece transfers are independent, so ranks may write different numbers of pieces.
* ``serial``: Rank 0 creates the file with every dataset and attribute; then the ranks take
  turns (rank order, one Barrier per turn) opening it with h5py and writing their pieces.

Atomic commit: the file is written as ``.<name>.tmp-<hex>`` in the target directory (the
name chosen by rank 0 and broadcast), fsynced by every rank, renamed by rank 0 with
``os.replace`` and the directory fsynced; then the ``latest`` pointer is replaced the same
way. A crash at any moment leaves the previous checkpoint and ``latest`` untouched; a
leftover temp file is ignored by :func:`latest_checkpoint` and removed by the next save.

Errors are agreed on before anyone proceeds: each phase ends with one small collective that
raises the same :class:`CheckpointError` on every rank, naming the rank that failed.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import json
import os
import re
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from mpidist.checkpoint.format import (
    ATTR_S1,
    ATTR_S2,
    CHECKSUM_ALGORITHM,
    FORMAT_NAME,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    Piece,
    TensorInfo,
    as_piece,
    as_tensor_infos,
    check_flat,
    checksum_update,
    compare_tensors,
    encode_attrs,
    flat_blocks,
    group_paths,
    validate_names,
)

__all__ = [
    "LATEST",
    "checkpoint_path",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_metadata",
    "read_pieces",
    "read_tensor",
    "save_checkpoint",
]

LATEST = "latest"
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
#: The I/O modes (``MPIDIST_CHECKPOINT_IO``); see the module docstring.
IO_MODES = ("posix", "mpio", "serial")
ATTR_S1_B, ATTR_S2_B = ATTR_S1.encode("ascii"), ATTR_S2.encode("ascii")
_TMP_RE = re.compile(r"^\..+\.tmp-[0-9a-f]+$")
_ERRORS = {c.__name__: c for c in (CheckpointError, CorruptCheckpointError,
                                   CheckpointFormatError, CheckpointMismatchError)}


# -- small helpers -----------------------------------------------------------------------------
def _h5py() -> Any:
    import h5py

    return h5py


def _size_rank(comm: Any) -> tuple[int, int]:
    if comm is None:
        return 1, 0
    return comm.Get_size(), comm.Get_rank()


def _io_mode(comm: Any, serial: bool | None) -> str:
    """``"posix"``, ``"mpio"`` or ``"serial"``: how this save or load moves its bytes.

    ``serial=True`` (or, when ``serial`` is None, ``MPIDIST_CHECKPOINT_SERIAL=1``) selects
    the serial fallback; otherwise ``MPIDIST_CHECKPOINT_IO`` (default ``posix``), where
    ``serial=False`` turns ``serial`` into ``posix`` and ``mpio`` needs h5py built with MPI
    and more than one rank (else ``posix``). Not collective: callers check the result
    agrees across ranks. Raises ValueError naming a bad ``MPIDIST_CHECKPOINT_IO``.
    """
    size, _ = _size_rank(comm)
    env = os.environ.get("MPIDIST_CHECKPOINT_IO", "").strip().lower() or "posix"
    if env not in IO_MODES:
        raise ValueError(f"MPIDIST_CHECKPOINT_IO={env!r} must be one of {list(IO_MODES)}")
    if serial is None:
        serial = env == "serial" or os.environ.get(
            "MPIDIST_CHECKPOINT_SERIAL", "0").strip().lower() not in ("", "0", "false", "no")
    if serial:
        return "serial"
    if env == "mpio" and size > 1 and bool(_h5py().get_config().mpi):
        return "mpio"
    return "posix"


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _Failure(Exception):
    """A local failure carried to the agreement step with the error class to raise."""

    def __init__(self, message: str, cls: type[CheckpointError] = CheckpointError) -> None:
        super().__init__(message)
        self.cls = cls


def _agree(comm: Any, failure: _Failure | None) -> None:
    """Collective over ``comm``: raise the first rank's failure on every rank, if any."""
    size, _ = _size_rank(comm)
    if size == 1:
        if failure is not None:
            raise failure.cls(str(failure))
        return
    payload = None if failure is None else (failure.cls.__name__, str(failure))
    everyone = comm.allgather(payload)
    for r, item in enumerate(everyone):
        if item is not None:
            cls = _ERRORS.get(item[0], CheckpointError)
            raise cls(f"[rank {r}] {item[1]}" if size > 1 else item[1])


@contextlib.contextmanager
def _capture(cls: type[CheckpointError] = CheckpointError) -> Iterator[list[_Failure]]:
    """Collect an exception from the body as a :class:`_Failure` instead of raising it."""
    box: list[_Failure] = []
    try:
        yield box
    except _Failure as exc:
        box.append(exc)
    except CheckpointError as exc:
        box.append(_Failure(str(exc), type(exc)))
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        box.append(_Failure(_describe(exc), cls))


def _first(box: list[_Failure]) -> _Failure | None:
    return box[0] if box else None


def _selection(dsid: Any, shape: tuple[int, ...], a: int, b: int) -> tuple[Any, Any]:
    """File and memory dataspaces for flat elements ``[a, b)`` of a dataset."""
    h5s = _h5py().h5s
    fspace = dsid.get_space()
    if not shape:
        fspace.select_all()
    else:
        op = h5s.SELECT_SET
        for offset, count in flat_blocks(shape, a, b):
            fspace.select_hyperslab(offset, count, op=op)
            op = h5s.SELECT_OR
    return h5s.create_simple((b - a,)), fspace


def _chunks(a: int, b: int, itemsize: int) -> Iterator[tuple[int, int]]:
    step = max(1, MAX_TRANSFER_BYTES // max(1, itemsize))
    for lo in range(a, b, step):
        yield lo, min(b, lo + step)


def _write_range(ds: Any, a: int, data: np.ndarray) -> None:
    shape = tuple(ds.shape)
    data = np.ascontiguousarray(data)
    for lo, hi in _chunks(a, a + data.shape[0], data.dtype.itemsize):
        mspace, fspace = _selection(ds.id, shape, lo, hi)
        ds.id.write(mspace, fspace, data[lo - a:hi - a])


def _read_range(ds: Any, a: int, out: np.ndarray) -> None:
    shape = tuple(ds.shape)
    for lo, hi in _chunks(a, a + out.shape[0], out.dtype.itemsize):
        mspace, fspace = _selection(ds.id, shape, lo, hi)
        ds.id.read(mspace, fspace, out[lo - a:hi - a])


@functools.lru_cache(maxsize=64)
def _dataset_dtype(dtype: str) -> np.dtype:
    dt = np.dtype(dtype)
    return dt if dt.itemsize == 1 or dt.kind == "b" else dt.newbyteorder("<")


# -- paths -------------------------------------------------------------------------------------
def checkpoint_path(directory: str | os.PathLike[str], step: int) -> str:
    """The conventional file name of the checkpoint of ``step``: ``ckpt-00000100.h5``."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative integer")
    return os.path.join(os.fspath(directory), f"ckpt-{int(step):08d}.h5")


def _read_root_quick(path: str) -> dict[str, Any] | None:
    """Root attributes of an mpidist checkpoint, or None for anything else."""
    h5py = _h5py()
    try:
        with h5py.File(path, "r") as f:
            if _attr_str(f.attrs.get("format")) != FORMAT_NAME:
                return None
            return {"step": int(f.attrs.get("step", -1))}
    except (OSError, ValueError, TypeError, KeyError):
        return None


def list_checkpoints(directory: str | os.PathLike[str]) -> list[str]:
    """Committed checkpoints in ``directory``, oldest first (by ``step``, then mtime).

    Not collective. A committed checkpoint is a non-hidden ``*.h5`` file whose root
    attribute ``format`` is ``"mpidist-checkpoint"``; temp files are hidden, so never listed.
    """
    directory = os.fspath(directory)
    found = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        if entry.name.startswith(".") or not entry.name.endswith(".h5") or not entry.is_file():
            continue
        root = _read_root_quick(entry.path)
        if root is None:
            continue
        found.append((root["step"], entry.stat().st_mtime_ns, entry.name, entry.path))
    return [p for *_, p in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """Path of the newest committed checkpoint in ``directory``, or None. Not collective.

    Follows the ``latest`` pointer when it names an existing file; otherwise (no pointer,
    or a crash between a rename and the pointer update) the newest file of
    :func:`list_checkpoints`. Temp files of interrupted saves are never returned.
    """
    directory = os.fspath(directory)
    try:
        with open(os.path.join(directory, LATEST), encoding="utf-8") as fh:
            name = fh.read().strip()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        name = ""
    if name and "/" not in name and not name.startswith("."):
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate):
            return candidate
    found = list_checkpoints(directory)
    return found[-1] if found else None


def _write_latest(directory: str, name: str) -> None:
    tmp = os.path.join(directory, f".{LATEST}.tmp-{secrets.token_hex(4)}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(directory, LATEST))
    _fsync_path(directory, directory=True)


def _retain(directory: str, keep: int | None, current: str, started_ns: int) -> None:
    """Delete all but the newest ``keep`` checkpoints and stale temp files (rank 0 only)."""
    if keep is not None:
        found = list_checkpoints(directory)
        protected = {os.path.abspath(current)}
        pointed = latest_checkpoint(directory)
        if pointed is not None:
            protected.add(os.path.abspath(pointed))
        for old in found[:-keep] if keep < len(found) else []:
            if os.path.abspath(old) not in protected:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(old)
    # Temp files older than this save belong to interrupted saves; newer ones could be a
    # concurrent writer's, which we leave alone.
    for entry in os.scandir(directory):
        if _TMP_RE.match(entry.name) and entry.is_file():
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_mtime_ns < started_ns:
                    os.remove(entry.path)


# -- save ----------------------------------------------------------------------------------------
def _validate_pieces(pieces: Sequence[Piece], infos: Mapping[str, TensorInfo],
                     index: Mapping[str, int]) -> np.ndarray:
    """``(tensor index, start, stop)`` rows of the pieces, after checking each one."""
    rows = np.empty((len(pieces), 3), dtype=np.int64)
    for k, p in enumerate(pieces):
        if p.name not in infos:
            raise ValueError(f"piece names tensor {p.name!r}, which is not in `tensors`")
        info = infos[p.name]
        a, b = check_flat(p.name, p.flat, info.numel)
        data = p.data
        if not isinstance(data, np.ndarray) or data.ndim != 1:
            raise ValueError(f"piece of {p.name!r}: data must be a 1-D numpy array")
        if data.shape[0] != b - a:
            raise ValueError(
                f"piece of {p.name!r}: data has {data.shape[0]} elements for range [{a}, {b})"
            )
        if data.dtype.name != info.dtype:
            raise ValueError(f"piece of {p.name!r}: data dtype {data.dtype} != {info.dtype}")
        rows[k] = (index[p.name], a, b)
    return rows


def _check_coverage(all_rows: Sequence[np.ndarray], names: Sequence[str],
                    infos: Mapping[str, TensorInfo]) -> None:
    """Raise unless the pieces of all ranks cover every tensor exactly once."""
    tagged = [np.column_stack([rows, np.full(len(rows), r, dtype=np.int64)])
              for r, rows in enumerate(all_rows) if len(rows)]
    table = np.concatenate(tagged) if tagged else np.empty((0, 4), dtype=np.int64)
    table = table[table[:, 1] < table[:, 2]]  # empty pieces cover nothing
    table = table[np.lexsort((table[:, 1], table[:, 0]))]
    problems: list[str] = []
    k = 0
    for t, name in enumerate(names):
        pos = 0
        while k < len(table) and table[k, 0] == t:
            _, a, b, r = (int(x) for x in table[k])
            if a > pos:
                problems.append(f"{name!r}: elements [{pos}, {a}) are written by no rank")
            elif a < pos:
                problems.append(f"{name!r}: elements [{a}, {min(b, pos)}) are written twice "
                                f"(rank {r} and another)")
            pos = max(pos, b)
            k += 1
        if pos < infos[name].numel:
            problems.append(f"{name!r}: elements [{pos}, {infos[name].numel}) are written by "
                            "no rank")
    if problems:
        more = f" ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ValueError("pieces must cover every tensor exactly once: "
                         + "; ".join(problems[:10]) + more)


def _file_options(names: Sequence[str], root: Mapping[str, Any]) -> dict[str, Any]:
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


def _create_layout(f: Any, names: Sequence[str], infos: Mapping[str, TensorInfo],
                   sums: np.ndarray | None, root: Mapping[str, Any]) -> np.ndarray:
    """Groups, datasets and attributes, in sorted order (collective under mpio).

    Every dataset is contiguous with its space allocated now and never filled, the same in
    every I/O mode. ``sums`` None writes zero checksums, to be filled in by
    :func:`_patch_sums`. Returns each dataset's byte offset in the file (int64, in
    ``names`` order; -1 for an empty tensor, which has no storage).
    """
    h5py = _h5py()
    h5a, h5d, h5p, h5s, h5t = h5py.h5a, h5py.h5d, h5py.h5p, h5py.h5s, h5py.h5t
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
            types[info.dtype] = h5t.py_create(_dataset_dtype(info.dtype), logical=True)
        space = h5s.create_simple(info.shape) if info.shape else scalar
        dsid = h5d.create(f.id, name.encode("utf-8"), types[info.dtype], space, dcpl=dcpl)
        for key, value in ((ATTR_S1_B, sums[t, 0]), (ATTR_S2_B, sums[t, 1])):
            aid = h5a.create(dsid, key, u64, scalar)
            aid.write(np.array(value, dtype="<u8"))
            aid.close()
        offset = dsid.get_offset()
        if offset is not None and info.numel:
            offsets[t] = offset
        dsid.close()
    return offsets


def _write_pieces(f: Any, pieces: Sequence[Piece]) -> None:
    for p in pieces:
        if p.data.shape[0]:  # validated by _validate_pieces: flat is [start, start + len)
            _write_range(f[p.name], int(p.flat.start or 0), p.data)


def _patch_sums(path: str, names: Sequence[str], sums: np.ndarray) -> None:
    """Overwrite the checksum attributes :func:`_create_layout` made as zeros (same size,
    so HDF5 rewrites them in place)."""
    h5py = _h5py()
    h5a, h5d = h5py.h5a, h5py.h5d
    with h5py.File(path, "r+") as f:
        for t, name in enumerate(names):
            dsid = h5d.open(f.id, name.encode("utf-8"))
            try:
                for key, value in ((ATTR_S1_B, sums[t, 0]), (ATTR_S2_B, sums[t, 1])):
                    aid = h5a.open(dsid, key)
                    aid.write(np.array(value, dtype="<u8"))
                    aid.close()
            finally:
                dsid.close()


@functools.cache
def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` where there is one (Linux), else None."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _writeback_bytes() -> int:
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


class _Writeback:
    """Asks the kernel to start writing back each written range of about ``every`` bytes.

    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` only starts the writeback and does not wait
    for it, so the disk works while the next chunks are checksummed and copied, and the
    closing fsync (still the durability point) finds the pages mostly clean. A no-op where
    the call is missing or fails, or with ``MPIDIST_CHECKPOINT_WRITEBACK_MB=0``.
    """

    WRITE = 2  # SYNC_FILE_RANGE_WRITE

    def __init__(self, fd: int, every: int) -> None:
        self.fd, self.every = fd, every
        self.fn = _sync_file_range() if every > 0 else None
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


def _pwrite_array(fd: int, offset: int, data: np.ndarray, stored: np.dtype,
                  writeback: _Writeback, sums: tuple[int, int], first: int) -> tuple[int, int]:
    """Write ``data`` as ``stored`` (little-endian) bytes at ``offset`` and return ``sums``
    plus its checksum (elements ``first, first+1, ...``), chunk by chunk: each chunk is
    summed while it is in cache, written, and handed to ``writeback``."""
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
    return sums


def _pread_array(fd: int, offset: int, out: np.ndarray, stored: np.dtype, path: str) -> None:
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


def save_checkpoint(
    path: str | os.PathLike[str],
    tensors: Mapping[str, TensorInfo | tuple[Sequence[int], Any]],
    pieces: Iterable[Piece | tuple[str, slice, np.ndarray]],
    attrs: Mapping[str, Any] | None = None,
    *,
    comm: Any = None,
    keep: int | None = None,
    serial: bool | None = None,
) -> str:
    """Write a checkpoint atomically to ``path`` and point ``latest`` at it.

    Collective over ``comm`` (None: one process). Every rank passes the same ``path``,
    ``tensors``, ``attrs``, ``keep`` and ``serial``, and its own ``pieces``; together the
    pieces of all ranks must cover every element of every tensor exactly once. A violation
    of either (e.g. ranks disagreeing on ``tensors``) raises the same
    :class:`CheckpointError` on every rank before anything is written.

    Args:
        path: final file name; its directory is created if needed and also holds the temp
            file and the ``latest`` pointer.
        tensors: ``{name: TensorInfo(shape, dtype)}`` of the global tensors; names are
            '/'-separated HDF5 paths (groups are created for the prefixes).
        pieces: this rank's ``Piece(name, flat slice, 1-D data)``.
        attrs: JSON-able metadata (step, strategy, mesh, optimizer, data position, ...).
        keep: after committing, delete all but the newest ``keep`` checkpoints of the
            directory (never the new one or the one ``latest`` names).
        serial: force (True) or forbid (False) the serial fallback; default: the
            ``MPIDIST_CHECKPOINT_SERIAL`` and ``MPIDIST_CHECKPOINT_IO`` environment
            variables, else the ``posix`` mode (see the module docstring). Every mode
            writes the same file.

    Returns:
        ``path`` as a string.
    """
    from mpidist._version import __version__

    size, rank = _size_rank(comm)
    path = os.fspath(path)
    own = comm.Dup() if size > 1 else None
    try:
        # 1. validate locally, then agree: same arguments everywhere, and no rank failed.
        with _capture() as box:
            infos = as_tensor_infos(tensors)
            validate_names(infos)
            names = sorted(infos)
            index = {n: t for t, n in enumerate(names)}
            plain, whole = encode_attrs(dict(attrs or {}))
            if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int)
                                     or keep < 1):
                raise ValueError(f"keep={keep!r} must be a positive integer or None")
            plist = [as_piece(p) for p in pieces]
            rows = _validate_pieces(plist, infos, index)
            mode = _io_mode(comm, serial)
            writeback = _writeback_bytes()
        failure = _first(box)
        if failure is None:
            digest = hashlib.sha256(json.dumps(
                [os.path.abspath(path), [(n, infos[n].shape, infos[n].dtype) for n in names],
                 whole, keep, mode, writeback]).encode()).hexdigest()
        else:
            rows, digest = np.empty((0, 3), dtype=np.int64), ""
        if own is None:
            _agree(own, failure)
            all_rows = [rows]
        else:
            everyone = own.allgather((None if failure is None else
                                      (failure.cls.__name__, str(failure)), digest, rows))
            for r, (err, _, _) in enumerate(everyone):
                if err is not None:
                    raise _ERRORS.get(err[0], CheckpointError)(f"[rank {r}] {err[1]}")
            digests = [d for _, d, _ in everyone]
            if len(set(digests)) > 1:
                differ = [r for r, d in enumerate(digests) if d != digests[0]]
                raise CheckpointError(
                    f"ranks {differ} passed a different path, tensors, attrs, keep or I/O mode "
                    "than rank 0 to save_checkpoint"
                )
            all_rows = [r for _, _, r in everyone]
        with _capture() as box:
            _check_coverage(all_rows, names, infos)
        _agree(own, _first(box))  # every rank checked the same table: the same verdict

        # 2. checksums: partial sums of the local pieces, summed mod 2**64 over ranks (the
        #    posix mode computes them while writing).
        sums = None if mode == "posix" else _global_sums(plist, rows, len(names), own)

        # 3. rank 0 names the temp file and stamps the time; everyone gets the same values.
        directory = os.path.dirname(os.path.abspath(path))
        header = None
        if rank == 0:
            with _capture() as box:
                os.makedirs(directory, exist_ok=True)
                now = datetime.datetime.now(datetime.timezone.utc)
                tmp = os.path.join(directory,
                                   f".{os.path.basename(path)}.tmp-{secrets.token_hex(6)}")
                header = (tmp, now.isoformat(timespec="seconds").replace("+00:00", "Z"),
                          time.time_ns())
            failure = _first(box)
            msg = None if failure is None else str(failure)
        else:
            msg = None
        if own is not None:
            header, msg = own.bcast((header, msg), root=0)
        if msg is not None:
            raise CheckpointError(f"[rank 0] cannot prepare {directory!r}: {msg}")
        tmp, created, started_ns = header
        root = dict(plain, format=FORMAT_NAME, format_version=np.int64(FORMAT_VERSION),
                    library_version=__version__, created=created, metadata_json=whole,
                    checksum_algorithm=CHECKSUM_ALGORITHM, num_tensors=np.int64(len(names)))

        # 4. write the temp file and fsync it on every rank.
        try:
            if mode == "posix":
                _save_posix(tmp, names, infos, root, plist, rows, own, writeback)
            elif mode == "mpio":
                _save_mpio(tmp, names, infos, sums, root, plist, own)
            else:
                _save_serial(tmp, names, infos, sums, root, plist, own)
        except CheckpointError:
            if rank == 0:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
            raise

        # 5. commit: rename, fsync the directory, move `latest`, apply retention.
        msg = None
        if rank == 0:
            with _capture() as box:
                os.replace(tmp, path)
                _fsync_path(directory, directory=True)
                _write_latest(directory, os.path.basename(path))
                _retain(directory, keep, path, started_ns)
            failure = _first(box)
            msg = None if failure is None else str(failure)
        if own is not None:
            msg = own.bcast(msg, root=0)
        if msg is not None:
            raise CheckpointError(f"[rank 0] committing {path!r} failed: {msg}")
        return path
    finally:
        if own is not None:
            own.Free()


def _global_sums(pieces: Sequence[Piece], rows: np.ndarray, n: int, comm: Any) -> np.ndarray:
    """Checksums ``(n, 2)`` of the tensors: local partial sums, summed mod 2**64 over ranks.

    Collective over ``comm`` (None: one process).
    """
    sums = np.zeros((n, 2), dtype=np.uint64)
    for p, (t, a, _) in zip(pieces, rows, strict=True):
        sums[t] = checksum_update((int(sums[t, 0]), int(sums[t, 1])), p.data, int(a))
    if comm is not None:
        from mpi4py import MPI

        comm.Allreduce(MPI.IN_PLACE, [sums, MPI.UINT64_T], op=MPI.SUM)
    return sums


def _save_posix(tmp: str, names: Sequence[str], infos: Mapping[str, TensorInfo],
                root: Mapping[str, Any], pieces: Sequence[Piece], rows: np.ndarray,
                comm: Any, writeback_bytes: int) -> None:
    """Rank 0 lays the file out with HDF5; every rank pwrites its bytes. Collective.

    One pass over each rank's data: every chunk is checksummed and written while it is in
    cache, and the kernel is asked to start writing it back at once (``sync_file_range``
    on Linux), so the final fsync finds little left to do. The checksum attributes are
    created as zeros with the layout and filled in by rank 0 once the sums are known.
    """
    size, rank = _size_rank(comm)
    offsets = np.full(len(names), -1, dtype=np.int64)
    failure = None
    if rank == 0:
        with _capture() as box:
            with _h5py().File(tmp, "w", **_file_options(names, root)) as f:
                offsets[:] = _create_layout(f, names, infos, None, root)
            lost = [n for n, o in zip(names, offsets, strict=True) if o < 0 and infos[n].numel]
            if lost:  # only if HDF5 ignored the early allocation we asked for
                raise RuntimeError(f"HDF5 allocated no contiguous storage for {lost[:5]}")
        failure = _first(box)
    _agree(comm, failure)
    if comm is not None:
        comm.Bcast(offsets, root=0)
    sums = np.zeros((len(names), 2), dtype=np.uint64)
    fd = -1
    try:
        with _capture() as box:
            fd = os.open(tmp, os.O_WRONLY)
            writeback = _Writeback(fd, writeback_bytes)
            # File order, so each rank's writes move forward through the file.
            order = sorted(range(len(pieces)),
                           key=lambda k: (int(offsets[rows[k, 0]]), int(rows[k, 1])))
            for k in order:
                t, a, b = (int(x) for x in rows[k])
                if b > a:
                    stored = _dataset_dtype(infos[names[t]].dtype)
                    sums[t] = _pwrite_array(fd, int(offsets[t]) + a * stored.itemsize,
                                            pieces[k].data, stored, writeback,
                                            (int(sums[t, 0]), int(sums[t, 1])), a)
            writeback.flush()
        _agree(comm, _first(box))
        if comm is not None:
            from mpi4py import MPI

            comm.Allreduce(MPI.IN_PLACE, [sums, MPI.UINT64_T], op=MPI.SUM)
        with _capture() as box:
            if rank == 0:
                _patch_sums(tmp, names, sums)
            # Every rank flushes what it wrote (on a shared file system the dirty pages
            # live on the writer's node); rank 0's fsync also covers the HDF5 metadata.
            os.fsync(fd)
        _agree(comm, _first(box))
    finally:
        if fd >= 0:
            os.close(fd)


def _save_mpio(tmp: str, names: Sequence[str], infos: Mapping[str, TensorInfo],
               sums: np.ndarray, root: Mapping[str, Any], pieces: Sequence[Piece],
               comm: Any) -> None:
    h5py = _h5py()
    with _capture() as box:
        f = h5py.File(tmp, "w", driver="mpio", comm=comm, **_file_options(names, root))
    _agree(comm, _first(box))
    write_box: list[_Failure] = []
    try:
        with _capture() as box:
            _create_layout(f, names, infos, sums, root)
        _agree(comm, _first(box))
        # Independent transfers: a failure here must not skip the collective close.
        with _capture() as write_box:
            _write_pieces(f, pieces)
    finally:
        with _capture() as close_box:
            f.close()
    with _capture() as sync_box:
        # Each rank flushes what its node wrote (on a shared file system the pages live on
        # the writer's node); cheap when another rank already did it.
        _fsync_path(tmp)
    _agree(comm, _first(write_box) or _first(close_box) or _first(sync_box))


def _save_serial(tmp: str, names: Sequence[str], infos: Mapping[str, TensorInfo],
                 sums: np.ndarray, root: Mapping[str, Any], pieces: Sequence[Piece],
                 comm: Any) -> None:
    h5py = _h5py()
    size, rank = _size_rank(comm)
    failure = None
    if rank == 0:
        with _capture() as box, h5py.File(tmp, "w", **_file_options(names, root)) as f:
            _create_layout(f, names, infos, sums, root)
            _write_pieces(f, pieces)
        if not box:
            with _capture() as box:
                _fsync_path(tmp)
        failure = _first(box)
    _agree(comm, failure)
    # Token passing: one writer at a time, in rank order. HDF5 without MPI has no
    # coordination between processes, so concurrent writers would corrupt the metadata.
    failure = None
    for turn in range(1, size):
        if rank == turn and pieces:
            with _capture() as box:
                with h5py.File(tmp, "r+") as f:
                    _write_pieces(f, pieces)
                _fsync_path(tmp)
            failure = _first(box)
        comm.Barrier()
    _agree(comm, failure)


# -- load ----------------------------------------------------------------------------------------
def _attr_str(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def _open_error(path: str, exc: BaseException) -> CheckpointError:
    if isinstance(exc, FileNotFoundError) or not os.path.exists(path):
        return CheckpointError(f"checkpoint {path!r} does not exist")
    return CorruptCheckpointError(
        f"checkpoint {path!r} cannot be read as HDF5 (truncated or corrupted file?): "
        f"{_describe(exc)}"
    )


def _read_header(path: str) -> tuple[dict[str, Any], dict[str, TensorInfo],
                                      dict[str, tuple[int, int]]]:
    """Metadata, tensors and stored checksums of a checkpoint; raises CheckpointError."""
    meta, infos, sums, _ = _read_header_offsets(path)
    return meta, infos, sums


def _raw_offset(dsid: Any, info: TensorInfo) -> int:
    """Byte offset of a dataset (low-level id) whose elements ``pread`` can read, else -1.

    That is a contiguous dataset with allocated storage of exactly ``numel * itemsize``
    bytes whose file type is the little-endian type this library writes for ``info.dtype``
    (mpidist's own files always are). Anything else (chunked, filtered, external,
    big-endian, padded compound: files written by other tools) is read through h5py.
    """
    h5py = _h5py()
    if not info.numel:
        return -1
    dcpl = dsid.get_create_plist()
    if dcpl.get_layout() != h5py.h5d.CONTIGUOUS or dcpl.get_external_count():
        return -1
    offset = dsid.get_offset()
    stored = _dataset_dtype(info.dtype)
    if offset is None or dsid.get_storage_size() != info.numel * stored.itemsize:
        return -1
    if dsid.get_type() != h5py.h5t.py_create(stored, logical=True):
        return -1
    return int(offset)


def _scalar_attr(obj_id: Any, key: bytes) -> int | None:
    """A numeric scalar attribute of a low-level object id as int; None if absent."""
    h5a = _h5py().h5a
    if not h5a.exists(obj_id, key):
        return None
    aid = h5a.open(obj_id, key)
    try:
        buf = np.empty(aid.shape, dtype=aid.dtype)
        aid.read(buf)
    finally:
        aid.close()
    if buf.size != 1 or buf.dtype.kind not in "iu":
        raise ValueError(f"attribute {key.decode()!r} is not an integer scalar")
    return int(buf.reshape(-1)[0])


def _read_header_offsets(path: str) -> tuple[dict[str, Any], dict[str, TensorInfo],
                                             dict[str, tuple[int, int]], np.ndarray]:
    """:func:`_read_header` plus each tensor's :func:`_raw_offset` (int64, sorted names)."""
    h5py = _h5py()
    try:
        f = h5py.File(path, "r")
    except (OSError, ValueError) as exc:
        raise _open_error(path, exc) from None
    try:
        with f:
            fmt = _attr_str(f.attrs.get("format"))
            if fmt != FORMAT_NAME:
                raise CheckpointFormatError(
                    f"{path!r} is not an mpidist checkpoint: root attribute format={fmt!r}, "
                    f"expected {FORMAT_NAME!r}"
                )
            version = f.attrs.get("format_version")
            if isinstance(version, np.generic):
                version = version.item()
            if not isinstance(version, int) or version != FORMAT_VERSION:
                raise CheckpointFormatError(
                    f"{path!r} has format_version={version!r}; this library reads version "
                    f"{FORMAT_VERSION}"
                )
            alg = _attr_str(f.attrs.get("checksum_algorithm"))
            if alg != CHECKSUM_ALGORITHM:
                raise CheckpointFormatError(
                    f"{path!r} uses checksum_algorithm={alg!r}, expected {CHECKSUM_ALGORITHM!r}"
                )
            try:
                meta = json.loads(_attr_str(f.attrs["metadata_json"]))
            except (KeyError, ValueError, TypeError) as exc:
                raise CorruptCheckpointError(
                    f"{path!r}: root attribute metadata_json is missing or not JSON: {exc}"
                ) from None
            meta.update(format=FORMAT_NAME, format_version=FORMAT_VERSION,
                        library_version=_attr_str(f.attrs.get("library_version")),
                        created=_attr_str(f.attrs.get("created")))
            infos: dict[str, TensorInfo] = {}
            sums: dict[str, tuple[int, int]] = {}
            raw: dict[str, int] = {}
            problems: list[str] = []

            # The low-level API: h5py's visititems and attrs cost 3x more per dataset.
            h5d, h5o = h5py.h5d, h5py.h5o
            found: list[bytes] = []
            h5o.visit(f.id, lambda name, oi: found.append(name)
                      if oi.type == h5o.TYPE_DATASET else None, info=True)
            for bname in found:
                name = bname.decode("utf-8")
                dsid = h5d.open(f.id, bname)
                try:
                    dt = dsid.dtype
                    if dt.kind not in "fiubc" or dt.fields is not None:
                        problems.append(f"dataset {name!r} has non-numeric dtype {dt}")
                        continue
                    infos[name] = TensorInfo(tuple(dsid.shape), dt.name)
                    raw[name] = _raw_offset(dsid, infos[name])
                    s1, s2 = _scalar_attr(dsid, ATTR_S1_B), _scalar_attr(dsid, ATTR_S2_B)
                    if s1 is None or s2 is None:
                        problems.append(f"dataset {name!r} has no checksum attributes")
                    else:
                        sums[name] = (s1, s2)
                finally:
                    dsid.close()
            if problems:
                raise CorruptCheckpointError(f"{path!r}: " + "; ".join(problems))
            count = f.attrs.get("num_tensors")
            if count is not None and int(count) != len(infos):
                raise CorruptCheckpointError(
                    f"{path!r}: root says num_tensors={int(count)} but {len(infos)} datasets "
                    "were found"
                )
            infos = dict(sorted(infos.items()))
            offsets = np.array([raw[n] for n in infos], dtype=np.int64)
            return meta, infos, sums, offsets
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CorruptCheckpointError(
            f"{path!r}: metadata cannot be read (corrupted file?): {_describe(exc)}"
        ) from None


def read_metadata(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """``(attrs, {name: TensorInfo})`` of a checkpoint. Not collective; any rank may call it.

    ``attrs`` is the mapping given to :func:`save_checkpoint` plus ``format``,
    ``format_version``, ``library_version`` and ``created``. Raises
    :class:`CheckpointFormatError` for another format or version and
    :class:`CorruptCheckpointError` for an unreadable file.
    """
    meta, infos, _ = _read_header(os.fspath(path))
    return meta, infos


def _verify_plan(reqs_of: Sequence[np.ndarray], numels: Sequence[int], size: int,
                 rank: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Who sums which elements so every requested tensor is checksummed exactly once.

    ``reqs_of[r]`` holds rank r's requests as ``(tensor, start, stop)`` rows. Each element
    read by some rank is summed once, by the first request (in start order) covering it;
    elements of a requested tensor that nobody reads are read additionally, by ranks in
    turn. Returns this rank's ``(request index, start, stop)`` and ``(tensor, start, stop)``
    ranges. Every rank computes the same plan from the same gathered table.
    """
    rows = [(int(t), int(a), int(b), r, k) for r, reqs in enumerate(reqs_of)
            for k, (t, a, b) in enumerate(reqs) if a < b]
    rows.sort()
    by_tensor: dict[int, list[tuple[int, int, int, int]]] = {}
    for t, a, b, r, k in rows:
        by_tensor.setdefault(t, []).append((a, b, r, k))
    # tensors requested only with empty ranges still get verified
    for reqs in reqs_of:
        for t, _, _ in reqs:
            by_tensor.setdefault(int(t), [])
    owned: list[tuple[int, int, int]] = []
    extra: list[tuple[int, int, int]] = []
    turn = 0
    for t in sorted(by_tensor):
        pos = 0
        gaps = []
        for a, b, r, k in by_tensor[t]:
            if a > pos:
                gaps.append((pos, a))
            lo = max(a, pos)
            if b > lo and r == rank:
                owned.append((k, lo, b))
            pos = max(pos, b)
        if pos < numels[t]:
            gaps.append((pos, numels[t]))
        for lo, hi in gaps:
            if turn % size == rank:
                extra.append((t, lo, hi))
            turn += 1
    return owned, extra


class _Reader:
    """Reads flat element ranges of the checkpoint's tensors in one of the I/O modes.

    ``mpio``: the file opened with h5py's mpio driver (opening and closing are collective
    over ``comm``; reads independent). ``serial``: h5py with the default driver.
    ``posix``: ``pread`` at the offsets rank 0 found; tensors without one (not plain
    contiguous, see :func:`_raw_offset`) through h5py, opened on first need.
    """

    def __init__(self, path: str, mode: str, comm: Any, names: Sequence[str],
                 infos: Mapping[str, TensorInfo], offsets: np.ndarray) -> None:
        self.path, self.names, self.infos, self.offsets = path, names, infos, offsets
        self.fd = -1
        self.h5: Any = None
        if mode == "posix":
            self.fd = os.open(path, os.O_RDONLY)
        elif mode == "mpio":
            self.h5 = _h5py().File(path, "r", driver="mpio", comm=comm)
        else:
            self.h5 = _h5py().File(path, "r")
        self.mode = mode

    def read(self, t: int, a: int, out: np.ndarray) -> None:
        """Elements ``[a, a + len(out))`` of tensor ``t`` into ``out``."""
        name = self.names[t]
        if self.mode == "posix" and self.offsets[t] >= 0:
            stored = _dataset_dtype(self.infos[name].dtype)
            _pread_array(self.fd, int(self.offsets[t]) + a * stored.itemsize, out, stored,
                         self.path)
            return
        if self.h5 is None:
            self.h5 = _h5py().File(self.path, "r")
        _read_range(self.h5[name], a, out)

    def close(self) -> None:
        """Collective in ``mpio`` mode."""
        try:
            if self.h5 is not None:
                self.h5.close()
        finally:
            if self.fd >= 0:
                os.close(self.fd)


def read_pieces(
    path: str | os.PathLike[str],
    requests: Iterable[Piece | tuple[str, slice, np.ndarray]],
    *,
    comm: Any = None,
    expected: Mapping[str, TensorInfo | tuple[Sequence[int], Any]] | None = None,
    strict: bool = True,
    verify: bool = True,
    serial: bool | None = None,
) -> dict[str, Any]:
    """Read this rank's pieces of a checkpoint into the given arrays; returns its attrs.

    Collective over ``comm`` (None: one process); every rank passes the same ``path``,
    ``expected``, ``strict``, ``verify`` and ``serial``, and its own ``requests``
    ``(name, flat slice, out)``: elements ``flat`` of the C-order flattened tensor are read
    into the 1-D array ``out`` (same dtype as stored). Requests of different ranks may
    overlap or leave gaps, so any sharding at any world size can load any checkpoint.
    ``path`` may be a directory: its :func:`latest_checkpoint` is read.

    Rank 0 validates the header (format, version, tensor list against ``expected``)
    before anyone reads data; with ``verify`` every tensor that any rank requested is
    checksummed in full (elements nobody requested are read once more for this) and a
    mismatch raises :class:`CorruptCheckpointError` naming the tensors. Every failure
    raises the same error on every rank.

    I/O mode (rank 0's ``serial`` / environment decides, see the module docstring): by
    default rank 0 also finds each dataset's file offset and every rank ``pread``s its
    ranges directly; ``mpio`` and ``serial`` read through h5py. The result is the same.
    """
    size, rank = _size_rank(comm)
    path = os.fspath(path)
    own = comm.Dup() if size > 1 else None
    try:
        # 1. rank 0 reads and checks the header; everyone gets it (or its error).
        header = failure = None
        if rank == 0:
            with _capture() as box:
                # Rank 0 decides the I/O mode for everyone: ranks that disagreed would
                # mix collective and independent opens and hang.
                mode = _io_mode(comm, serial)
                if os.path.isdir(path):
                    found = latest_checkpoint(path)
                    if found is None:
                        raise CheckpointError(f"no checkpoint in directory {path!r}")
                    path = found
                meta, infos, sums, offsets = _read_header_offsets(path)
                header = (path, meta, infos, sums, mode)
                if expected is not None:
                    exp = as_tensor_infos(expected)
                    msg = compare_tensors(header[2], exp, strict=strict)
                    if msg is not None:
                        raise CheckpointMismatchError(f"{path!r}: {msg}")
            failure = _first(box)
        if own is not None:
            header, failure = own.bcast((header, failure and (failure.cls.__name__,
                                                                str(failure))), root=0)
            if failure is not None:
                raise _ERRORS.get(failure[0], CheckpointError)(failure[1])
        elif failure is not None:
            raise failure.cls(str(failure))
        path, meta, infos, sums, mode = header
        names = list(infos)
        index = {n: t for t, n in enumerate(names)}
        if rank != 0:
            offsets = np.empty(len(names), dtype=np.int64)
        if own is not None:
            own.Bcast(offsets, root=0)

        # 2. every rank checks its own requests; agree.
        with _capture() as box:
            reqs = [as_piece(q) for q in requests]
            rows = np.empty((len(reqs), 3), dtype=np.int64)
            for k, q in enumerate(reqs):
                if q.name not in infos:
                    raise CheckpointMismatchError(
                        f"request for tensor {q.name!r}, which {path!r} does not hold")
                info = infos[q.name]
                a, b = check_flat(q.name, q.flat, info.numel)
                out = q.data
                if (not isinstance(out, np.ndarray) or out.ndim != 1
                        or not out.flags.c_contiguous or not out.flags.writeable):
                    raise ValueError(f"request for {q.name!r}: out must be a writable, "
                                     "contiguous 1-D numpy array")
                if out.shape[0] != b - a:
                    raise ValueError(f"request for {q.name!r}: out has {out.shape[0]} "
                                     f"elements for range [{a}, {b})")
                if out.dtype.name != info.dtype:
                    raise ValueError(f"request for {q.name!r}: out dtype {out.dtype} differs "
                                     f"from the stored {info.dtype}")
                rows[k] = (index[q.name], a, b)
        _agree(own, _first(box))

        # 3. read, and sum what this rank is responsible for.
        reqs_of = own.allgather(rows) if (own is not None and verify) else [rows]
        part = np.zeros((len(names), 2), dtype=np.uint64)
        with _capture(CorruptCheckpointError) as box:
            f = _Reader(path, mode, own, names, infos, offsets)
        _agree(own, _first(box))
        try:
            with _capture(CorruptCheckpointError) as box:
                # File order, so each rank's reads move forward through the file.
                order = sorted(range(len(reqs)),
                               key=lambda k: (int(offsets[rows[k, 0]]), int(rows[k, 1])))
                for k in order:
                    if reqs[k].data.shape[0]:
                        f.read(int(rows[k, 0]), int(rows[k, 1]), reqs[k].data)
                if verify:
                    owned, extra = _verify_plan(reqs_of, [infos[n].numel for n in names],
                                                size, rank)
                    for k, lo, hi in owned:
                        t, a = int(rows[k, 0]), int(rows[k, 1])
                        part[t] = checksum_update((int(part[t, 0]), int(part[t, 1])),
                                                  reqs[k].data[lo - a:hi - a], lo)
                    for t, lo, hi in extra:
                        part[t] = _sum_range(f, t, lo, hi, infos[names[t]].dtype,
                                             (int(part[t, 0]), int(part[t, 1])))
        finally:
            with _capture(CorruptCheckpointError) as close_box:
                f.close()
        _agree(own, _first(box) or _first(close_box))

        # 4. combine and compare the checksums; the verdict is the same on every rank.
        if verify:
            if own is not None:
                from mpi4py import MPI

                own.Allreduce(MPI.IN_PLACE, [part, MPI.UINT64_T], op=MPI.SUM)
            checked = sorted({int(t) for rs in reqs_of for t in rs[:, 0]})
            bad = [names[t] for t in checked
                   if (int(part[t, 0]), int(part[t, 1])) != sums[names[t]]]
            if bad:
                more = f" ... and {len(bad) - 10} more" if len(bad) > 10 else ""
                raise CorruptCheckpointError(
                    f"checksum mismatch in {path!r} for dataset(s) {bad[:10]}{more}: the data "
                    "on disk is not what was saved"
                )
        return meta
    finally:
        if own is not None:
            own.Free()


def _sum_range(f: _Reader, t: int, lo: int, hi: int, dtype: str,
               sums: tuple[int, int]) -> tuple[int, int]:
    step = max(1, MAX_TRANSFER_BYTES // np.dtype(dtype).itemsize // 4)
    buf = np.empty(min(step, hi - lo), dtype=np.dtype(dtype))
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        f.read(t, a, buf[:b - a])
        sums = checksum_update(sums, buf[:b - a], a)
    return sums


def load_checkpoint(
    path: str | os.PathLike[str],
    requests: Iterable[Piece | tuple[str, slice, np.ndarray]],
    *,
    expected: Mapping[str, TensorInfo | tuple[Sequence[int], Any]],
    comm: Any = None,
    strict: bool = True,
    verify: bool = True,
    serial: bool | None = None,
) -> dict[str, Any]:
    """:func:`read_pieces` that first checks the file holds exactly ``expected``.

    Collective over ``comm``. Missing, unexpected (unless ``strict=False``) and
    shape- or dtype-mismatched names raise :class:`CheckpointMismatchError` on every rank,
    listing each difference, before any data is read.
    """
    return read_pieces(path, requests, comm=comm, expected=expected, strict=strict,
                       verify=verify, serial=serial)


def read_tensor(path: str | os.PathLike[str], name: str, *, verify: bool = True) -> np.ndarray:
    """One whole tensor with its global shape, checksum-verified. Not collective."""
    path = os.fspath(path)
    _, infos, sums = _read_header(path)
    if name not in infos:
        raise CheckpointMismatchError(f"{path!r} has no tensor {name!r}")
    info = infos[name]
    out = np.empty(info.numel, dtype=np.dtype(info.dtype))
    read_pieces(path, [Piece(name, slice(0, info.numel), out)], verify=verify)
    return out.reshape(info.shape)
