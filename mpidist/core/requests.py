"""Pending nonblocking operations and MPI itself, as the collectives use them.

:class:`Request` completes a nonblocking collective or transfer (one MPI call, or the
stages of a two-level collective, :mod:`mpidist.core.topology`) and runs its finishing work
exactly once; :func:`wait_all` waits for several. :func:`mpi` imports ``mpi4py.MPI`` on
first use, so importing mpidist does not start MPI. Everything here is re-exported by
:mod:`mpidist.core.collectives`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from mpidist.core import calls
from mpidist.core import topology as _topo

__all__ = ["Request", "mpi", "mpi_op", "wait_all"]

_MPI: Any = None
_OPS: dict[str, Any] = {}


def mpi() -> Any:
    """mpi4py.MPI, imported on first use so that importing mpidist does not start MPI.
    Not collective."""
    global _MPI
    if _MPI is None:
        from mpi4py import MPI

        _OPS.update(sum=MPI.SUM, avg=MPI.SUM, max=MPI.MAX, min=MPI.MIN)
        _MPI = MPI
    return _MPI


def mpi_op(op: str) -> Any:
    """The MPI reduction of ``op`` (sum, avg -- a sum, scaled afterwards --, max, min).
    Not collective."""
    if not _OPS:
        mpi()
    return _OPS[op]


# -- requests -----------------------------------------------------------------------------
_LIVE: set[Request] = set()


class Request:
    """A pending nonblocking operation. ``wait()`` completes it and returns its result.

    Finishing work (averaging, unpadding, copying a staged result back to the device)
    happens in ``wait()``/a successful ``test()``, exactly once. A two-level collective is
    a sequence of stages (``stages``: a generator yielding lists of MPI requests); the next
    stage starts when the previous one has completed, in ``wait()`` or ``test()``.
    """

    def __init__(
        self,
        reqs: Sequence[Any],
        result: Any,
        finish: Callable[[], Any] | None = None,
        keep: tuple = (),
        stages: _topo.Stages | None = None,
    ) -> None:
        self._stages = stages
        if stages is not None:
            reqs = next(stages)
        self._reqs = list(reqs)
        self._result = result
        self._finish = finish
        self._done = False
        self._keep = keep  # buffers MPI reads or writes until completion stay alive
        if self._reqs:
            # A request in flight outlives whoever started it (a dropped model, a failed
            # test): its MPI requests and buffers must stay alive until MPI is done.
            _LIVE.add(self)

    def _complete(self) -> Any:
        if not self._done:
            self._done = True
            self._keep = ()
            _LIVE.discard(self)
            if self._finish is not None:
                out = self._finish()
                if out is not None:
                    self._result = out
        return self._result

    def _advance(self) -> bool:
        """Start the next stage; False when there is none."""
        if self._stages is None:
            return False
        try:
            self._reqs = next(self._stages)
        except StopIteration:
            self._stages = None
            return False
        return True

    def wait(self) -> Any:
        """Block until done; return the result (the output array)."""
        if not self._done:
            while True:
                if self._reqs:
                    if self._stages is not None and _POLL_SLEEP > 0:
                        _poll(self._reqs)
                    else:
                        calls.wait_all(self._reqs)
                if not self._advance():
                    break
        return self._complete()

    def test(self) -> bool:
        """True (and the result is ready) when done; drives MPI progress otherwise."""
        if self._done:
            return True
        while True:
            if self._reqs and not calls.test_all(self._reqs):
                return False
            if not self._advance():
                break
        self._complete()
        return True

    @property
    def done(self) -> bool:
        return self._done


_POLL_SLEEP = float(os.environ.get("MPIDIST_POLL_SLEEP", "0.0002"))


def _poll(reqs: list[Any]) -> None:
    # Sleep between tests rather than spin in Waitall: ranks waiting on the inter-node link
    # then leave the cores to the node's ranks doing shared-memory stages.
    test = calls.test_all
    with calls.blocked_in(calls.pending(reqs)):
        while not test(reqs):
            time.sleep(_POLL_SLEEP)


def wait_all(requests: Sequence[Request]) -> list[Any]:
    """Wait for every request; returns their results in order."""
    return [r.wait() for r in requests]
