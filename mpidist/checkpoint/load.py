"""Collective, verified reads of checkpoint pieces (see :mod:`mpidist.checkpoint.io`)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from mpidist.checkpoint.agreement import (
    agree,
    capture_failure,
    first_failure,
    h5py_module,
    io_mode,
    on_root,
    size_rank,
    sum_over,
)
from mpidist.checkpoint.format import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    Piece,
    TensorInfo,
    as_piece,
    as_tensor_infos,
    checksum_update,
    compare_tensors,
    piece_rows,
)
from mpidist.checkpoint.header import read_header, read_header_offsets
from mpidist.checkpoint.paths import latest_checkpoint
from mpidist.checkpoint.storage import (
    MAX_TRANSFER_BYTES,
    dataset_dtype,
    pread_array,
    read_chunks,
    read_range,
)
from mpidist.core.comms import label, traced

__all__ = ["Reader", "load_checkpoint", "read_pieces", "read_tensor", "sum_range",
           "verify_plan"]


def verify_plan(reqs_of: Sequence[np.ndarray], numels: Sequence[int], size: int,
                 rank: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Who sums which elements so every requested tensor is checksummed exactly once.

    ``reqs_of[r]`` holds rank r's requests as ``(tensor, start, stop)`` rows. Each element
    read by some rank is summed once, by the first request (in start order) covering it;
    elements of a requested tensor that nobody reads are read additionally, by ranks in
    turn. Returns this rank's ``(request index, start, stop)`` and ``(tensor, start, stop)``
    ranges. Every rank computes the same plan from the same gathered table.
    """
    rows = sorted((int(t), int(a), int(b), r, k) for r, reqs in enumerate(reqs_of)
                  for k, (t, a, b) in enumerate(reqs))
    owned: list[tuple[int, int, int]] = []
    extra: list[tuple[int, int, int]] = []
    turn = 0
    for t, group in itertools.groupby(rows, key=lambda row: row[0]):
        pos = 0
        gaps = []
        for _, a, b, r, k in group:
            if a == b:
                continue  # an empty request still gets its tensor verified
            if a > pos:
                gaps.append((pos, a))
            if b > max(a, pos) and r == rank:
                owned.append((k, max(a, pos), b))
            pos = max(pos, b)
        if pos < numels[t]:
            gaps.append((pos, numels[t]))
        for lo, hi in gaps:
            if turn % size == rank:
                extra.append((t, lo, hi))
            turn += 1
    return owned, extra


class Reader:
    """Reads flat element ranges of the checkpoint's tensors in one of the I/O modes.

    ``mpio``: the file opened with h5py's mpio driver (opening and closing are collective
    over ``comm``; reads independent). ``serial``: h5py with the default driver.
    ``posix``: ``pread`` at the offsets rank 0 found; tensors without one (not plain
    contiguous, see :func:`raw_offset`) through h5py, opened on first need.
    """

    def __init__(self, path: str, mode: str, comm: Any, names: Sequence[str],
                 infos: Mapping[str, TensorInfo], offsets: np.ndarray) -> None:
        self.path, self.names, self.infos, self.offsets = path, names, infos, offsets
        self.fd = -1
        self.h5: Any = None
        if mode == "posix":
            self.fd = os.open(path, os.O_RDONLY)
        elif mode == "mpio":
            self.h5 = h5py_module().File(path, "r", driver="mpio", comm=comm)
        else:
            self.h5 = h5py_module().File(path, "r")
        self.mode = mode

    def read(self, t: int, a: int, out: np.ndarray) -> None:
        """Elements ``[a, a + len(out))`` of tensor ``t`` into ``out``."""
        name = self.names[t]
        if self.mode == "posix" and self.offsets[t] >= 0:
            stored = dataset_dtype(self.infos[name].dtype)
            pread_array(self.fd, int(self.offsets[t]) + a * stored.itemsize, out, stored,
                         self.path)
            return
        if self.h5 is None:
            self.h5 = h5py_module().File(self.path, "r")
        read_range(self.h5[name], a, out)

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
    comm = traced(comm)
    size, rank = size_rank(comm)
    path = os.fspath(path)
    own = label(comm.Dup(), "checkpoint") if size > 1 else None
    try:
        # 1. rank 0 reads and checks the header; everyone gets it (or its error).
        path, meta, infos, sums, mode, offsets = _agree_on_header(
            path, comm, own, expected, strict, serial)
        names = list(infos)

        # 2. every rank checks its own requests; agree.
        with capture_failure() as box:
            reqs = [as_piece(q) for q in requests]
            rows = piece_rows(reqs, infos, {n: t for t, n in enumerate(names)}, reading=path)
        agree(own, first_failure(box))

        # 3. read, and sum what this rank is responsible for.
        reqs_of = own.allgather(rows) if (own is not None and verify) else [rows]
        part = _read_and_sum(path, mode, own, names, infos, offsets, reqs, rows,
                             reqs_of if verify else None, size, rank)

        # 4. combine and compare the checksums; the verdict is the same on every rank.
        if verify:
            _compare_sums(path, part, own, reqs_of, names, sums)
        return meta
    finally:
        if own is not None:
            own.Free()


def _agree_on_header(path: str, comm: Any, own: Any, expected: Any, strict: bool,
                     serial: bool | None) -> tuple[Any, ...]:
    """Rank 0 reads and checks the header and decides the I/O mode; every rank gets
    ``(path, meta, infos, sums, mode, offsets)`` or the same error. Collective over ``own``."""

    def header(path: str = path) -> tuple[Any, ...]:
        # Rank 0 decides the I/O mode for everyone: ranks that disagreed would mix
        # collective and independent opens and hang.
        mode = io_mode(comm, serial)
        if os.path.isdir(path):
            found = latest_checkpoint(path)
            if found is None:
                raise CheckpointError(f"no checkpoint in directory {path!r}")
            path = found
        meta, infos, sums, offsets = read_header_offsets(path)
        if expected is not None:
            msg = compare_tensors(infos, as_tensor_infos(expected), strict=strict)
            if msg is not None:
                raise CheckpointMismatchError(f"{path!r}: {msg}")
        return path, meta, infos, sums, mode, offsets

    return on_root(own, header)


def _read_and_sum(path: str, mode: str, own: Any, names: Sequence[str],
                  infos: Mapping[str, TensorInfo], offsets: np.ndarray,
                  reqs: Sequence[Piece], rows: np.ndarray,
                  reqs_of: Sequence[np.ndarray] | None, size: int, rank: int) -> np.ndarray:
    """Read this rank's requests and, when verifying (``reqs_of`` given), the partial
    checksums this rank is responsible for. Collective over ``own``."""
    part = np.zeros((len(names), 2), dtype=np.uint64)
    with capture_failure(CorruptCheckpointError) as box:
        f = Reader(path, mode, own, names, infos, offsets)
    agree(own, first_failure(box))
    try:
        with capture_failure(CorruptCheckpointError) as box:
            # File order, so each rank's reads move forward through the file.
            order = sorted(range(len(reqs)),
                           key=lambda k: (int(offsets[rows[k, 0]]), int(rows[k, 1])))
            for k in order:
                if reqs[k].data.shape[0]:
                    f.read(int(rows[k, 0]), int(rows[k, 1]), reqs[k].data)
            if reqs_of is not None:
                owned, extra = verify_plan(reqs_of, [infos[n].numel for n in names],
                                           size, rank)
                for k, lo, hi in owned:
                    t, a = int(rows[k, 0]), int(rows[k, 1])
                    part[t] = checksum_update((int(part[t, 0]), int(part[t, 1])),
                                              reqs[k].data[lo - a:hi - a], lo)
                for t, lo, hi in extra:
                    part[t] = sum_range(f, t, lo, hi, infos[names[t]].dtype,
                                        (int(part[t, 0]), int(part[t, 1])))
    finally:
        with capture_failure(CorruptCheckpointError) as close_box:
            f.close()
    agree(own, first_failure(box) or first_failure(close_box))
    return part


def _compare_sums(path: str, part: np.ndarray, own: Any, reqs_of: Sequence[np.ndarray],
                  names: Sequence[str], sums: Mapping[str, tuple[int, int]]) -> None:
    """Sum the partial checksums over the ranks and compare them with the stored ones.
    Collective over ``own``; the same verdict on every rank."""
    sum_over(own, part)
    checked = sorted({int(t) for rs in reqs_of for t in rs[:, 0]})
    bad = [names[t] for t in checked if (int(part[t, 0]), int(part[t, 1])) != sums[names[t]]]
    if bad:
        more = f" ... and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise CorruptCheckpointError(
            f"checksum mismatch in {path!r} for dataset(s) {bad[:10]}{more}: the data "
            "on disk is not what was saved"
        )


def sum_range(f: Reader, t: int, lo: int, hi: int, dtype: str,
              sums: tuple[int, int]) -> tuple[int, int]:
    """``sums`` plus the checksum of elements ``[lo, hi)`` of tensor ``t``, read from ``f``."""
    for a, chunk in read_chunks(lambda a, out: f.read(t, a, out), lo, hi, dtype,
                                MAX_TRANSFER_BYTES // 4):
        sums = checksum_update(sums, chunk, a)
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
    _, infos, sums = read_header(path)
    if name not in infos:
        raise CheckpointMismatchError(f"{path!r} has no tensor {name!r}")
    info = infos[name]
    out = np.empty(info.numel, dtype=np.dtype(info.dtype))
    read_pieces(path, [Piece(name, slice(0, info.numel), out)], verify=verify)
    return out.reshape(info.shape)
