"""The user's data cache: results computed once per data set and reused by later runs.

Entries live under :func:`cache_dir` (``$MPIDIST_CACHE_DIR``, else
``$XDG_CACHE_HOME/mpidist``, else ``~/.cache/mpidist``), named by a key that hashes what
identifies the data (real path, size, modification time in ns, inode). An entry is built by
one process at a time (an advisory ``flock`` on ``<key>.lock``; the others wait and then read
it), written under a temporary name and renamed, so a crash never leaves half an entry.
Deleting the directory is always safe: entries are rebuilt when missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["cache_dir", "cache_key", "cached_json", "file_identity", "locked_entry",
           "write_json_atomic"]

#: Bumped when what the entries hold changes, so that older entries are ignored.
CACHE_VERSION = 1


def cache_dir() -> str:
    """The cache directory (not created here)."""
    explicit = os.environ.get("MPIDIST_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mpidist")


def file_identity(path: str) -> list[Any]:
    """What identifies a file's content for the cache: real path, size, mtime (ns), inode."""
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino]


def cache_key(kind: str, *parts: Any) -> str:
    """A file-name-safe key for ``(kind, parts...)`` (JSON-able parts)."""
    text = json.dumps([CACHE_VERSION, kind, *parts], sort_keys=True, default=str)
    return f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"


@contextlib.contextmanager
def locked_entry(key: str) -> Iterator[str | None]:
    """Hold ``key``'s lock; yields the entry's path prefix (``<cache>/<key>``), or None when
    the cache directory cannot be used (the caller then computes without caching)."""
    root = cache_dir()
    try:
        os.makedirs(root, exist_ok=True)
        fd = os.open(os.path.join(root, key + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield None
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield os.path.join(root, key)
    finally:
        os.close(fd)  # releases the lock


def write_json_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def cached_json(key: str, build: Callable[[str | None], dict[str, Any]]) -> dict[str, Any]:
    """The JSON entry ``key``, built by ``build(prefix)`` when missing (``prefix`` is where
    the entry may keep files of its own, or None without a usable cache). Not collective;
    safe for several processes at once."""
    with locked_entry(key) as prefix:
        if prefix is None:
            return build(None)
        path = prefix + ".json"
        with contextlib.suppress(OSError, ValueError):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        entry = build(prefix)
        with contextlib.suppress(OSError):
            write_json_atomic(path, entry)
        return entry
