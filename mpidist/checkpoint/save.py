"""Collective, atomic save of a checkpoint (see :mod:`mpidist.checkpoint.io`)."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpidist.checkpoint.agreement import (
    ERRORS,
    Failure,
    agree,
    capture_failure,
    first_failure,
    fsync_path,
    h5py_module,
    io_mode,
    on_root,
    size_rank,
    sum_over,
)
from mpidist.checkpoint.format import (
    CHECKSUM_ALGORITHM,
    FORMAT_NAME,
    FORMAT_VERSION,
    CheckpointError,
    Piece,
    TensorInfo,
    as_piece,
    as_tensor_infos,
    checksum_update,
    encode_attrs,
    piece_rows,
    validate_names,
)
from mpidist.checkpoint.paths import retain, write_latest
from mpidist.checkpoint.storage import (
    Writeback,
    create_layout,
    dataset_dtype,
    file_options,
    patch_sums,
    pwrite_array,
    write_pieces,
    writeback_bytes,
)
from mpidist.core.comms import label, traced

__all__ = ["save_checkpoint"]


def check_coverage(all_rows: Sequence[np.ndarray], names: Sequence[str],
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

    comm = traced(comm)
    size, rank = size_rank(comm)
    path = os.fspath(path)
    own = label(comm.Dup(), "checkpoint") if size > 1 else None
    try:
        # 1. validate locally, then agree: same arguments everywhere, and no rank failed.
        plan = _agree_on_arguments(path, tensors, pieces, attrs, keep, serial, comm, own)
        names, infos, plist, rows = plan.names, plan.infos, plan.pieces, plan.rows

        # 2. checksums: partial sums of the local pieces, summed mod 2**64 over ranks (the
        #    posix mode computes them while writing).
        sums = None if plan.mode == "posix" else global_sums(plist, rows, len(names), own)

        # 3. rank 0 names the temp file and stamps the time; everyone gets the same values.
        directory = os.path.dirname(os.path.abspath(path))
        tmp, created, started_ns = _name_temp_file(path, directory, own)
        root = dict(plan.plain, format=FORMAT_NAME, format_version=np.int64(FORMAT_VERSION),
                    library_version=__version__, created=created, metadata_json=plan.whole,
                    checksum_algorithm=CHECKSUM_ALGORITHM, num_tensors=np.int64(len(names)))

        # 4. write the temp file and fsync it on every rank.
        try:
            if plan.mode == "posix":
                save_posix(tmp, names, infos, root, plist, rows, own, plan.writeback)
            elif plan.mode == "mpio":
                save_mpio(tmp, names, infos, sums, root, plist, own)
            else:
                save_serial(tmp, names, infos, sums, root, plist, own)
        except CheckpointError:
            if rank == 0:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
            raise

        # 5. commit: rename, fsync the directory, move `latest`, apply retention.
        _commit(path, tmp, directory, keep, started_ns, own)
        return path
    finally:
        if own is not None:
            own.Free()


@dataclass
class _SavePlan:
    """What every rank agreed on in phase 1 of a save."""

    names: list[str]
    infos: dict[str, TensorInfo]
    pieces: list[Piece]
    rows: np.ndarray
    mode: str
    writeback: int
    plain: dict[str, Any]
    whole: str


def _agree_on_arguments(path: str, tensors: Mapping[str, Any], pieces: Iterable[Any],
                        attrs: Mapping[str, Any] | None, keep: int | None,
                        serial: bool | None, comm: Any, own: Any) -> _SavePlan:
    """Validate the arguments locally, then agree over ``own``: the same arguments on every
    rank, no rank failed, and the pieces cover every element once. Collective."""
    with capture_failure() as box:
        infos = as_tensor_infos(tensors)
        validate_names(infos)
        names = sorted(infos)
        index = {n: t for t, n in enumerate(names)}
        plain, whole = encode_attrs(dict(attrs or {}))
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int)
                                 or keep < 1):
            raise ValueError(f"keep={keep!r} must be a positive integer or None")
        plist = [as_piece(p) for p in pieces]
        rows = piece_rows(plist, infos, index)
        mode = io_mode(comm, serial)
        writeback = writeback_bytes()
    failure = first_failure(box)
    if failure is None:
        digest = hashlib.sha256(json.dumps(
            [os.path.abspath(path), [(n, infos[n].shape, infos[n].dtype) for n in names],
             whole, keep, mode, writeback]).encode()).hexdigest()
    else:
        rows, digest = np.empty((0, 3), dtype=np.int64), ""
    if own is None:
        agree(own, failure)
        all_rows = [rows]
    else:
        everyone = own.allgather((None if failure is None else
                                  (failure.cls.__name__, str(failure)), digest, rows))
        for r, (err, _, _) in enumerate(everyone):
            if err is not None:
                raise ERRORS.get(err[0], CheckpointError)(f"[rank {r}] {err[1]}")
        digests = [d for _, d, _ in everyone]
        if len(set(digests)) > 1:
            differ = [r for r, d in enumerate(digests) if d != digests[0]]
            raise CheckpointError(
                f"ranks {differ} passed a different path, tensors, attrs, keep or I/O mode "
                "than rank 0 to save_checkpoint"
            )
        all_rows = [r for _, _, r in everyone]
    with capture_failure() as box:
        check_coverage(all_rows, names, infos)
    agree(own, first_failure(box))  # every rank checked the same table: the same verdict
    return _SavePlan(names, infos, plist, rows, mode, writeback, plain, whole)


def _name_temp_file(path: str, directory: str, own: Any) -> tuple[str, str, int]:
    """Rank 0 makes the directory and names the temp file; ``(tmp, created, started_ns)``
    on every rank. Collective over ``own``."""

    def name() -> tuple[str, str, int]:
        os.makedirs(directory, exist_ok=True)
        now = datetime.datetime.now(datetime.timezone.utc)
        return (os.path.join(directory, f".{os.path.basename(path)}.tmp-{secrets.token_hex(6)}"),
                now.isoformat(timespec="seconds").replace("+00:00", "Z"), time.time_ns())

    return on_root(own, name, f"cannot prepare {directory!r}")


def _commit(path: str, tmp: str, directory: str, keep: int | None, started_ns: int,
            own: Any) -> None:
    """Rank 0 renames the temp file, fsyncs the directory, moves ``latest`` and applies
    retention; every rank gets the verdict. Collective over ``own``."""

    def commit() -> None:
        os.replace(tmp, path)
        fsync_path(directory, directory=True)
        write_latest(directory, os.path.basename(path))
        retain(directory, keep, path, started_ns)

    on_root(own, commit, f"committing {path!r} failed")


def global_sums(pieces: Sequence[Piece], rows: np.ndarray, n: int, comm: Any) -> np.ndarray:
    """Checksums ``(n, 2)`` of the tensors: local partial sums, summed mod 2**64 over ranks.

    Collective over ``comm`` (None: one process).
    """
    sums = np.zeros((n, 2), dtype=np.uint64)
    for p, (t, a, _) in zip(pieces, rows, strict=True):
        sums[t] = checksum_update((int(sums[t, 0]), int(sums[t, 1])), p.data, int(a))
    return sum_over(comm, sums)


def save_posix(tmp: str, names: Sequence[str], infos: Mapping[str, TensorInfo],
                root: Mapping[str, Any], pieces: Sequence[Piece], rows: np.ndarray,
                comm: Any, writeback_bytes: int) -> None:
    """Rank 0 lays the file out with HDF5; every rank pwrites its bytes. Collective.

    One pass over each rank's data: every chunk is checksummed and written while it is in
    cache, and the kernel is asked to start writing it back at once (``sync_file_range``
    on Linux), so the final fsync finds little left to do. The checksum attributes are
    created as zeros with the layout and filled in by rank 0 once the sums are known.
    """
    size, rank = size_rank(comm)
    offsets = np.full(len(names), -1, dtype=np.int64)
    failure = None
    if rank == 0:
        with capture_failure() as box:
            with h5py_module().File(tmp, "w", **file_options(names, root)) as f:
                offsets[:] = create_layout(f, names, infos, None, root)
            lost = [n for n, o in zip(names, offsets, strict=True) if o < 0 and infos[n].numel]
            if lost:  # only if HDF5 ignored the early allocation we asked for
                raise RuntimeError(f"HDF5 allocated no contiguous storage for {lost[:5]}")
        failure = first_failure(box)
    agree(comm, failure)
    if comm is not None:
        comm.Bcast(offsets, root=0)
    sums = np.zeros((len(names), 2), dtype=np.uint64)
    fd = -1
    try:
        with capture_failure() as box:
            fd = os.open(tmp, os.O_WRONLY)
            writeback = Writeback(fd, writeback_bytes)
            # File order, so each rank's writes move forward through the file.
            order = sorted(range(len(pieces)),
                           key=lambda k: (int(offsets[rows[k, 0]]), int(rows[k, 1])))
            for k in order:
                t, a, b = (int(x) for x in rows[k])
                if b > a:
                    stored = dataset_dtype(infos[names[t]].dtype)
                    sums[t] = pwrite_array(fd, int(offsets[t]) + a * stored.itemsize,
                                            pieces[k].data, stored, writeback,
                                            (int(sums[t, 0]), int(sums[t, 1])), a)
            writeback.flush()
        agree(comm, first_failure(box))
        sum_over(comm, sums)
        with capture_failure() as box:
            if rank == 0:
                patch_sums(tmp, names, sums)
            # Every rank flushes what it wrote (on a shared file system the dirty pages
            # live on the writer's node); rank 0's fsync also covers the HDF5 metadata.
            os.fsync(fd)
        agree(comm, first_failure(box))
    finally:
        if fd >= 0:
            os.close(fd)


def save_mpio(tmp: str, names: Sequence[str], infos: Mapping[str, TensorInfo],
               sums: np.ndarray, root: Mapping[str, Any], pieces: Sequence[Piece],
               comm: Any) -> None:
    h5py = h5py_module()
    with capture_failure() as box:
        f = h5py.File(tmp, "w", driver="mpio", comm=comm, **file_options(names, root))
    agree(comm, first_failure(box))
    write_box: list[Failure] = []
    try:
        with capture_failure() as box:
            create_layout(f, names, infos, sums, root)
        agree(comm, first_failure(box))
        # Independent transfers: a failure here must not skip the collective close.
        with capture_failure() as write_box:
            write_pieces(f, pieces)
    finally:
        with capture_failure() as close_box:
            f.close()
    with capture_failure() as sync_box:
        # Each rank flushes what its node wrote (on a shared file system the pages live on
        # the writer's node); cheap when another rank already did it.
        fsync_path(tmp)
    agree(comm, first_failure(write_box) or first_failure(close_box) or first_failure(sync_box))


def save_serial(tmp: str, names: Sequence[str], infos: Mapping[str, TensorInfo],
                 sums: np.ndarray, root: Mapping[str, Any], pieces: Sequence[Piece],
                 comm: Any) -> None:
    h5py = h5py_module()
    size, rank = size_rank(comm)
    failure = None
    if rank == 0:
        with capture_failure() as box, h5py.File(tmp, "w", **file_options(names, root)) as f:
            create_layout(f, names, infos, sums, root)
            write_pieces(f, pieces)
        if not box:
            with capture_failure() as box:
                fsync_path(tmp)
        failure = first_failure(box)
    agree(comm, failure)
    # Token passing: one writer at a time, in rank order. HDF5 without MPI has no
    # coordination between processes, so concurrent writers would corrupt the metadata.
    failure = None
    for turn in range(1, size):
        if rank == turn and pieces:
            with capture_failure() as box:
                with h5py.File(tmp, "r+") as f:
                    write_pieces(f, pieces)
                fsync_path(tmp)
            failure = first_failure(box)
        comm.Barrier()
    agree(comm, failure)
