"""Argument checks, the layout MPI is given and the cross-rank debug check of the collectives.

The checks run before anything is communicated and raise one line naming the value
(``TypeError``/``ValueError``). :func:`wire` is how arrays go to MPI outside reductions
(16-bit floats as ``uint16``); :func:`two_level` picks a two-level collective or the flat
one. Debug mode (``MPIDIST_DEBUG=1`` or :func:`set_debug`): :func:`maybe_check` compares
every rank's operation, dtype and shape with one small Allgather and raises
:class:`CollectiveMismatchError` on every rank when they differ. The public names of the
collectives' API here are re-exported by :mod:`mpidist.core.collectives`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpidist.core import devices as _dev
from mpidist.core import topology as _topo

__all__ = [
    "REDUCE_OPS", "REDUCIBLE", "CollectiveMismatchError", "check_array", "check_op",
    "check_out", "check_signature", "debug_enabled", "flat", "group_size", "maybe_check",
    "set_debug", "two_level", "wire",
]

#: the reductions the collectives run
REDUCE_OPS = ("sum", "avg", "max", "min")
#: the element types reductions support
REDUCIBLE = {np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64)}
_SIG_BYTES = 160

_debug = os.environ.get("MPIDIST_DEBUG", "0") not in ("", "0", "false", "no")


class CollectiveMismatchError(RuntimeError):
    """Ranks called different collectives, or the same one with different shapes/dtypes."""


def set_debug(enabled: bool) -> bool:
    """Turn the cross-rank collective check on or off; returns the previous setting.

    Must be set the same on every rank of a communicator (the check is itself a collective).
    """
    global _debug
    previous, _debug = _debug, bool(enabled)
    return previous


def debug_enabled() -> bool:
    """Whether the cross-rank collective check is on (``MPIDIST_DEBUG=1`` or
    :func:`set_debug`). Not collective."""
    return _debug


def check_signature(comm: Any, signature: str) -> None:
    """Collective over ``comm``: raise :class:`CollectiveMismatchError` on every rank when
    the ranks' ``signature`` strings (operation, dtype, shape, ...) differ, naming the ranks
    of each variant. The first 160 bytes of a signature are compared."""
    if group_size(comm) > 1:
        _debug_check(comm, signature)


def group_size(comm: Any) -> int:
    """The size of ``comm``; 1 for ``comm=None``. Not collective."""
    return 1 if comm is None else comm.Get_size()


def check_op(op: str, allowed: Sequence[str] = REDUCE_OPS) -> None:
    """ValueError naming ``op`` unless it is one of ``allowed``. Not collective."""
    if op not in allowed:
        raise ValueError(f"op={op!r} is not one of {tuple(allowed)}")


def check_array(a: Any, what: str, reduce: bool = False) -> Any:
    """``a`` as the collectives use it (a device array as a Numba view of it), after
    checking it; TypeError/ValueError naming ``what`` otherwise. Not collective."""
    if _dev.is_device(a):
        a = _dev.view(a)
        dtype = np.dtype(a.dtype)
    elif isinstance(a, np.ndarray):
        if not a.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous; got strides {a.strides}")
        dtype = a.dtype
    else:
        raise TypeError(f"{what} must be a NumPy or CUDA array, not {type(a).__name__}")
    if reduce and dtype not in REDUCIBLE:
        raise ValueError(
            f"{what} has dtype {dtype}; reductions support "
            f"{sorted(str(d) for d in REDUCIBLE)}"
        )
    return a


def check_out(out: Any, size: int, dtype: Any, what: str, reduce: bool = False) -> Any:
    """``out`` checked as by :func:`check_array` and to hold ``size`` elements of ``dtype``."""
    o = check_array(out, f"{what} output", reduce)
    if o.size != size or np.dtype(o.dtype) != np.dtype(dtype):
        raise ValueError(f"{what} output has shape {tuple(o.shape)} and dtype {o.dtype}; "
                         f"need {size} elements of {dtype}")
    return o


def flat(a: np.ndarray) -> np.ndarray:
    """``a`` as a flat view (a copy only if it is not contiguous). Not collective."""
    return a.reshape(-1)


def wire(a: Any) -> Any:
    """``a`` flat, as MPI is given it outside reductions: 16-bit floats (float16, bfloat16)
    viewed as ``uint16``, which MPI carries bit for bit (it has no such float types)."""
    a = flat(a)
    dt = np.dtype(a.dtype)
    return a.view(np.uint16) if dt.itemsize == 2 and dt.kind not in "iu" else a


# -- debug check --------------------------------------------------------------------------
def _debug_check(comm: Any, sig: str) -> None:
    """Collective: every rank's signature must match, else raise on every rank."""
    raw = sig.encode()[:_SIG_BYTES].ljust(_SIG_BYTES, b"\0")
    mine = np.frombuffer(raw, dtype=np.uint8).copy()
    everyone = np.empty((comm.Get_size(), _SIG_BYTES), dtype=np.uint8)
    comm.Allgather(mine, everyone)
    sigs = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in everyone]
    if len(set(sigs)) > 1:
        groups: dict[str, list[int]] = {}
        for r, s in enumerate(sigs):
            groups.setdefault(s, []).append(r)
        detail = "; ".join(f"ranks {rs}: {s}" for s, rs in groups.items())
        raise CollectiveMismatchError(f"collective mismatch on a group of {len(sigs)}: {detail}")


def maybe_check(comm: Any, name: str, a: Any, extra: str = "") -> None:
    """Collective over ``comm``: the debug check of operation ``name`` on ``a`` (its dtype and
    shape, then ``extra``); raises :class:`CollectiveMismatchError` on every rank when the
    ranks differ. The collectives call it only in debug mode."""
    _debug_check(comm, f"{name} dtype={np.dtype(a.dtype)} shape={tuple(a.shape)}{extra}")


def two_level(comm: Any, host: Any, nbytes: int, algorithm: str) -> _topo.Topology | None:
    """The topology for a two-level collective on ``host``, or None for the flat one. Not
    collective.

    Two levels work on host arrays (their stages reduce with NumPy); device buffers that a
    CUDA-aware MPI takes directly use the flat collective."""
    if not isinstance(host, np.ndarray):
        return None
    return _topo.choose_algorithm(comm, nbytes, algorithm)
