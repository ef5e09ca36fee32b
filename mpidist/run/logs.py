"""Logging for MPI programs: rank 0 speaks at INFO; other ranks only warn, with their rank."""

from __future__ import annotations

import logging
import sys

__all__ = ["setup_logging"]


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
