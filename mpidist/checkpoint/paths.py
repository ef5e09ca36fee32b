"""Checkpoint paths: the conventional names, the ``latest`` pointer, listing, and the
retention of the newest ``keep``."""

from __future__ import annotations

import contextlib
import os
import re
import secrets

import numpy as np

from mpidist.checkpoint.agreement import fsync_path, h5py_module
from mpidist.checkpoint.format import FORMAT_NAME
from mpidist.checkpoint.header import attr_str

__all__ = ["LATEST", "TMP_RE", "checkpoint_path", "checkpoint_step", "latest_checkpoint",
           "list_checkpoints", "retain", "write_atomic", "write_latest"]

LATEST = "latest"
TMP_RE = re.compile(r"^\..+\.tmp-[0-9a-f]+$")


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> str:
    """The conventional file name of the checkpoint of ``step``: ``ckpt-00000100.h5``."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative integer")
    return os.path.join(os.fspath(directory), f"ckpt-{int(step):08d}.h5")


def checkpoint_step(path: str) -> int | None:
    """The ``step`` attribute of an mpidist checkpoint (-1 if none), or None for any other
    file. Not collective."""
    try:
        with h5py_module().File(path, "r") as f:
            if attr_str(f.attrs.get("format")) != FORMAT_NAME:
                return None
            return int(f.attrs.get("step", -1))
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
        step = checkpoint_step(entry.path)
        if step is not None:
            found.append((step, entry.stat().st_mtime_ns, entry.name, entry.path))
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


def write_atomic(path: str, text: str) -> None:
    """Replace ``path``'s content with ``text`` so that a crash leaves the old file or the
    new one, never part of either: written and fsynced under a temporary name beside it
    (``.NAME.tmp-HEX``, which :func:`retain` cleans up), then renamed. Not collective."""
    tmp = os.path.join(os.path.dirname(path) or ".",
                       f".{os.path.basename(path)}.tmp-{secrets.token_hex(4)}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_latest(directory: str, name: str) -> None:
    write_atomic(os.path.join(directory, LATEST), name + "\n")
    fsync_path(directory, directory=True)


def retain(directory: str, keep: int | None, current: str, started_ns: int) -> None:
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
        if TMP_RE.match(entry.name) and entry.is_file():
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_mtime_ns < started_ns:
                    os.remove(entry.path)
