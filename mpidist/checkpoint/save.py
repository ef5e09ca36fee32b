"""Collective, atomic save of a checkpoint (see :mod:`mpidist.checkpoint.io`), blocking or
asynchronous (:mod:`mpidist.checkpoint.background`)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from mpidist.checkpoint.agreement import (
    Failure,
    agree,
    capture_failure,
    first_failure,
    fsync_path,
    h5py_module,
    size_rank,
)
from mpidist.checkpoint.background import (
    AsyncCheckpoint,
    HostPool,
    default_pool,
    wait_in_flight,
)
from mpidist.checkpoint.format import (
    CHECKSUM_ALGORITHM,
    FORMAT_NAME,
    FORMAT_VERSION,
    CheckpointError,
    Piece,
    TensorInfo,
)
from mpidist.checkpoint.phases import (
    SavePlan,
    agree_on_arguments,
    check_coverage,
    commit_file,
    finish_sums,
    global_sums,
    layout_posix,
    name_temp_file,
    step_of,
)
from mpidist.checkpoint.storage import create_layout, file_options, write_pieces
from mpidist.checkpoint.writer import WriterContext, write_rank_bytes, writer_hook
from mpidist.core.comms import label, traced

__all__ = ["check_coverage", "global_sums", "save_checkpoint"]


def save_checkpoint(
    path: str | os.PathLike[str],
    tensors: Mapping[str, TensorInfo | tuple[Sequence[int], Any]],
    pieces: Iterable[Piece | tuple[str, slice, Any]],
    attrs: Mapping[str, Any] | None = None,
    *,
    comm: Any = None,
    keep: int | None = None,
    serial: bool | None = None,
    async_: bool = False,
    pool: HostPool | None = None,
    owner: Any = None,
) -> Any:
    """Write a checkpoint atomically to ``path`` and point ``latest`` at it.

    Collective over ``comm`` (None: one process). Every rank passes the same ``path``,
    ``tensors``, ``attrs``, ``keep``, ``serial`` and ``async_``, and its own ``pieces``;
    together the pieces of all ranks must cover every element of every tensor exactly once.
    A violation of either (e.g. ranks disagreeing on ``tensors``) raises the same
    :class:`CheckpointError` on every rank before anything is written. A save first waits
    for the asynchronous save in flight, if any, and commits it
    (:func:`~mpidist.checkpoint.background.wait_in_flight`).

    Args:
        path: final file name; its directory is created if needed and also holds the temp
            file and the ``latest`` pointer.
        tensors: ``{name: TensorInfo(shape, dtype)}`` of the global tensors; names are
            '/'-separated HDF5 paths (groups are created for the prefixes).
        pieces: this rank's ``Piece(name, flat slice, 1-D data)``; with ``async_`` the data
            may also be device arrays.
        attrs: JSON-able metadata (step, strategy, mesh, optimizer, data position, ...).
        keep: after committing, delete all but the newest ``keep`` checkpoints of the
            directory (never the new one or the one ``latest`` names).
        serial: force (True) or forbid (False) the serial fallback; default: the
            ``MPIDIST_CHECKPOINT_SERIAL`` and ``MPIDIST_CHECKPOINT_IO`` environment
            variables, else the ``posix`` mode (see the module docstring). Every mode
            writes the same file.
        async_: copy the pieces into ``pool`` (default: the process's
            :class:`~mpidist.checkpoint.background.HostPool`), lay the file out, and return
            an :class:`~mpidist.checkpoint.background.AsyncCheckpoint` while a background
            thread writes this rank's bytes; it commits later, collectively (its
            ``wait()``, ``poll()``, or the next save). Only the ``posix`` mode writes in the
            background: under ``mpio`` and ``serial`` the save completes before returning
            (from the snapshot) and the handle is already committed.
        owner: with ``async_``, the object whose steps poll the save (an optimizer).

    Returns:
        ``path`` as a string; with ``async_``, the save's handle.
    """
    wait_in_flight()
    t0 = time.perf_counter()
    comm = traced(comm)
    size, _ = size_rank(comm)
    path = os.fspath(path)
    pool = default_pool() if pool is None else pool
    own = label(comm.Dup(), "checkpoint") if size > 1 else None
    handle: AsyncCheckpoint | None = None
    try:
        # 1. validate locally (the snapshot taken), then agree: same arguments everywhere,
        #    and no rank failed.
        plan = agree_on_arguments(path, tensors, pieces, attrs, keep, serial, comm, own,
                                  prepare=pool.snapshot if async_ else None)
        handle = _write_and_commit(path, plan, keep, own, (pool, owner, t0) if async_ else None)
        return path if handle is None else handle
    finally:
        if handle is None or handle.committed:  # else the save in flight holds them
            if async_:
                pool.release()
            if own is not None:
                own.Free()


def _write_and_commit(path: str, plan: SavePlan, keep: int | None, own: Any,
                      asynchronous: tuple[HostPool, Any, float] | None
                      ) -> AsyncCheckpoint | None:
    """Phases 2-5 of a save; with ``asynchronous`` (pool, owner, start time) its handle:
    started in the posix mode (the write left to a thread, no commit yet), else
    committed. Collective over ``own``."""
    from mpidist._version import __version__

    names, infos, plist, rows = plan.names, plan.infos, plan.pieces, plan.rows
    t_plan = time.perf_counter()
    # 2. checksums: partial sums of the local pieces, summed mod 2**64 over ranks (the
    #    posix mode computes them while writing).
    sums = None if plan.mode == "posix" else global_sums(plist, rows, len(names), own)

    # 3. rank 0 names the temp file and stamps the time; everyone gets the same values.
    directory = os.path.dirname(os.path.abspath(path))
    tmp, created, started_ns = name_temp_file(path, directory, own)
    root = dict(plan.plain, format=FORMAT_NAME, format_version=np.int64(FORMAT_VERSION),
                library_version=__version__, created=created, metadata_json=plan.whole,
                checksum_algorithm=CHECKSUM_ALGORITHM, num_tensors=np.int64(len(names)))

    # 4. write the temp file and fsync it on every rank (asynchronous: lay it out and hand
    #    the writing to a background thread).
    try:
        if plan.mode == "posix" and asynchronous is not None:
            pool, owner, t0 = asynchronous
            offsets = layout_posix(tmp, names, infos, root, own)
            t_layout = time.perf_counter()
            handle = AsyncCheckpoint(path, plan, comm=own, keep=keep, owner=owner)
            handle.start(pool, tmp, started_ns, offsets)
            handle.blocking_seconds = time.perf_counter() - t0
            handle.phase_seconds = {
                "snapshot": pool.last_seconds, "layout": t_layout - t_plan,
                "agreement": t_plan - t0 - pool.last_seconds,
                "start": handle.blocking_seconds - (t_layout - t0)}
            return handle
        if plan.mode == "posix":
            save_posix(tmp, names, infos, root, plist, rows, own, plan.writeback)
        elif plan.mode == "mpio":
            save_mpio(tmp, names, infos, sums, root, plist, own)
        else:
            save_serial(tmp, names, infos, sums, root, plist, own)
    except CheckpointError:
        if own is None or own.Get_rank() == 0:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        raise

    # 5. commit: rename, fsync the directory, move `latest`, apply retention.
    commit_file(path, tmp, directory, keep, started_ns, own)
    if asynchronous is None:
        return None
    handle = AsyncCheckpoint(path, plan, keep=keep, owner=asynchronous[1])
    handle.committed = True  # written before returning: mpio or serial mode
    handle.blocking_seconds = time.perf_counter() - asynchronous[2]
    return handle


def save_posix(tmp: str, names: Sequence[str], infos: Mapping[str, TensorInfo],
               root: Mapping[str, Any], pieces: Sequence[Piece], rows: np.ndarray,
               comm: Any, writeback_bytes: int) -> None:
    """Rank 0 lays the file out with HDF5; every rank pwrites its bytes. Collective.

    One pass over each rank's data (:func:`~mpidist.checkpoint.writer.write_rank_bytes`):
    every chunk is checksummed and written while it is in cache, and the kernel is asked to
    start writing it back at once (``sync_file_range`` on Linux), so the final fsync finds
    little left to do. The checksum attributes are created as zeros with the layout and
    filled in by rank 0 once the sums are known.
    """
    size, rank = size_rank(comm)
    offsets = layout_posix(tmp, names, infos, root, comm)
    sums = np.zeros((len(names), 2), dtype=np.uint64)
    with capture_failure() as box:
        ctx = WriterContext(rank=rank, step=step_of(root), path=tmp, tmp=tmp,
                            asynchronous=False)
        sums = write_rank_bytes(tmp, names, infos, pieces, rows, offsets, writeback_bytes,
                                ctx, writer_hook())
    agree(comm, first_failure(box))
    finish_sums(tmp, names, sums, comm)


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
