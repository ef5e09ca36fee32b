"""Keep the memory a training step frees for the next step (glibc's allocator).

A forward and backward allocate and free the same large arrays every step (activations,
attention probabilities, gradients of activations: megabytes each). glibc serves blocks
above ``M_MMAP_THRESHOLD`` with fresh ``mmap`` pages and gives the top of its heap back to the
system once more than ``M_TRIM_THRESHOLD`` is free there; its default adjusts both as blocks
come and go, but not enough for this pattern, so each step touches new pages again and pays
a page fault per 4 KiB (measured on the GPT of ``benchmarks/model_step.py``: about 9,400
faults per step, some 20 ms of its 200). :func:`reuse_freed_memory` sets the two thresholds
so that freed blocks stay in the heap and are reused (the process's resident memory then
stays near its peak, as with a caching allocator). ``mpidist train`` calls it once at start;
a script with its own loop may too. Only the calling process is affected; not collective.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["MMAP_THRESHOLD_MAX", "reuse_freed_memory"]

#: glibc's upper limit for ``M_MMAP_THRESHOLD`` on 64-bit systems (32 MiB): larger arrays
#: are always mapped afresh.
MMAP_THRESHOLD_MAX = 32 * 2**20
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's own settings; where the user has set one, the allocator is theirs to tune.
_GLIBC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_done: bool | None = None


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only (not musl, not macOS)
        return libc if hasattr(libc, "mallopt") else None
    except (OSError, AttributeError, TypeError):
        return None


def reuse_freed_memory(retain_bytes: int = 2**30) -> bool:
    """Have glibc keep freed blocks of up to :data:`MMAP_THRESHOLD_MAX` in its heap, and up to
    ``retain_bytes`` free at the heap's top, for reuse instead of returning them to the system.

    Returns whether the settings were applied: ``False`` on a C library other than glibc, or
    where one of glibc's variables (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
    ``MALLOC_TOP_PAD_``) is set in the environment (the user's choice stands; setting one of
    them is also the way to keep glibc's defaults). Calling it again does nothing more.
    Affects this process only; not collective.
    """
    global _done
    if isinstance(retain_bytes, bool) or not isinstance(retain_bytes, int) or retain_bytes < 0:
        raise ValueError(f"retain_bytes must be a non-negative integer, got {retain_bytes!r}")
    if _done is not None:
        return _done
    libc = None if any(v in os.environ for v in _GLIBC_VARIABLES) else _glibc()
    _done = bool(
        libc is not None
        and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
        and libc.mallopt(_M_TRIM_THRESHOLD, min(retain_bytes, 2**31 - 1))
    )
    return _done
