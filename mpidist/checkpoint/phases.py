"""The phases of a save that blocking and asynchronous saves share: the agreement on the
arguments, the temp file's name, the posix layout, the checksums' completion and the
commit (see :mod:`mpidist.checkpoint.io` and ``docs/checkpoint-format.md``).

Each phase is collective over the save's own communicator (None: one process) and ends in
one small collective that raises the same :class:`CheckpointError` on every rank.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpidist.checkpoint.agreement import (
    ERRORS,
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
from mpidist.checkpoint.storage import create_layout, file_options, patch_sums, writeback_bytes

__all__ = ["SavePlan", "agree_on_arguments", "check_coverage", "commit_file", "finish_sums",
           "global_sums", "layout_posix", "name_temp_file", "step_of"]


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


@dataclass
class SavePlan:
    """What every rank agreed on in phase 1 of a save."""

    names: list[str]
    infos: dict[str, TensorInfo]
    pieces: list[Piece]
    rows: np.ndarray
    mode: str
    writeback: int
    plain: dict[str, Any]
    whole: str


def agree_on_arguments(path: str, tensors: Mapping[str, Any], pieces: Iterable[Any],
                       attrs: Mapping[str, Any] | None, keep: int | None,
                       serial: bool | None, comm: Any, own: Any,
                       prepare: Callable[[list[Piece]], list[Piece]] | None = None
                       ) -> SavePlan:
    """Validate the arguments locally, then agree over ``own``: the same arguments on every
    rank, no rank failed, and the pieces cover every element once. Collective.

    ``prepare`` (an asynchronous save's host snapshot) replaces the pieces before they are
    checked; its failure is agreed like any other.
    """
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
        if prepare is not None:
            plist = prepare(plist)
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
    return SavePlan(names, infos, plist, rows, mode, writeback, plain, whole)


def name_temp_file(path: str, directory: str, own: Any) -> tuple[str, str, int]:
    """Rank 0 makes the directory and names the temp file; ``(tmp, created, started_ns)``
    on every rank. Collective over ``own``."""

    def name() -> tuple[str, str, int]:
        os.makedirs(directory, exist_ok=True)
        now = datetime.datetime.now(datetime.timezone.utc)
        return (os.path.join(directory, f".{os.path.basename(path)}.tmp-{secrets.token_hex(6)}"),
                now.isoformat(timespec="seconds").replace("+00:00", "Z"), time.time_ns())

    return on_root(own, name, f"cannot prepare {directory!r}")


def commit_file(path: str, tmp: str, directory: str, keep: int | None, started_ns: int,
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


def layout_posix(tmp: str, names: Sequence[str], infos: Mapping[str, TensorInfo],
                 root: Mapping[str, Any], comm: Any) -> np.ndarray:
    """Rank 0 lays the temp file out with HDF5 (the checksum attributes as zeros); each
    dataset's byte offset (int64, -1 for an empty tensor) on every rank. Collective."""
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
    return offsets


def finish_sums(tmp: str, names: Sequence[str], sums: np.ndarray, comm: Any) -> None:
    """The posix mode after every rank wrote (and fsynced) its bytes: the partial checksums
    summed over the ranks, written by rank 0 into the zero attributes, which it fsyncs.
    Collective over ``comm``; a failure raises on every rank."""
    sum_over(comm, sums)
    failure = None
    if comm is None or comm.Get_rank() == 0:
        with capture_failure() as box:
            patch_sums(tmp, names, sums)
            fsync_path(tmp)
        failure = first_failure(box)
    agree(comm, failure)


def step_of(root: Mapping[str, Any]) -> int | None:
    """The training step a save's plain values name (``root["step"]``, an integer and not
    a bool), else None: what a writer hook's ``step=`` matches. Not collective."""
    step = root.get("step")
    if isinstance(step, (int, np.integer)) and not isinstance(step, bool):
        return int(step)
    return None
