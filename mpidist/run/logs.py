"""Logging for MPI programs: rank 0 speaks at INFO; other ranks only warn, with their rank."""

from __future__ import annotations

import logging
import sys

__all__ = ["append_to_run_log", "rank_prefixed", "set_run_log", "setup_logging"]


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(rank: int, level: int = logging.INFO) -> None:
    """Configure the ``mpidist`` loggers and Python warnings for this rank. Not collective.

    Rank 0 logs at ``level``; other ranks log warnings and errors only. Every message from a
    rank other than 0 carries ``[rank N]``, and so do ``warnings.warn`` messages.
    """
    root = logging.getLogger("mpidist")
    for h in list(root.handlers):
        if getattr(h, "_mpidist", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler._mpidist = True  # type: ignore[attr-defined]
    handler.addFilter(_RankFilter(rank))
    fmt = "%(levelname)s: %(message)s"
    if rank != 0:
        fmt = "[rank %(rank)d] " + fmt
    handler.setFormatter(logging.Formatter(fmt))
    root.addHandler(handler)
    root.setLevel(level if rank == 0 else logging.WARNING)
    root.propagate = False
    logging.captureWarnings(True)
    warn_log = logging.getLogger("py.warnings")
    for h in list(warn_log.handlers):
        if getattr(h, "_mpidist", False):
            warn_log.removeHandler(h)
    warn_log.addHandler(handler)
    warn_log.propagate = False


_RUN_LOG: dict[str, str | None] = {"path": None}


def set_run_log(path: str | None, rank: int) -> None:
    """Make ``path`` the run's log file (None: no log file). Not collective.

    Every rank remembers it, to append its traceback there when it fails; rank 0 also
    writes its ``mpidist`` log records there.
    """
    _RUN_LOG["path"] = path
    root = logging.getLogger("mpidist")
    for h in list(root.handlers):
        if getattr(h, "_mpidist_file", False):
            root.removeHandler(h)
            h.close()
    if path is not None and rank == 0:
        handler = logging.FileHandler(path, encoding="utf-8", delay=True)
        handler._mpidist_file = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s: %(message)s"))
        root.addHandler(handler)


def rank_prefixed(rank: int, text: str) -> str:
    """Every line of ``text`` prefixed with ``[rank N]``."""
    return "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n"))


def append_to_run_log(text: str, rank: int) -> str | None:
    """Append ``text`` (a traceback), each line prefixed with ``[rank N]``, to the run's
    log file; its path, or None when there is none or it cannot be written."""
    path = _RUN_LOG["path"]
    if path is None:
        return None
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(rank_prefixed(rank, text))
    except OSError:
        return None
    return path
