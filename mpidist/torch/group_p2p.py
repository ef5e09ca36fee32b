"""Barriers and point-to-point operations of the "mpidist" backend's process group.

:class:`P2PGroup` adds ``barrier``, ``monitored_barrier``, ``send``, ``recv`` and
``recv_anysource`` to :class:`mpidist.torch.group_base.GroupBase`;
:class:`mpidist.torch.process_group.ProcessGroupMPI` adds the collectives on top.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from mpidist.core.comms import mpi
from mpidist.torch import ops
from mpidist.torch.group_base import GroupBase, one_tensor
from mpidist.torch.mixed import handoff
from mpidist.torch.ops import Work, as_host, scratch, spec, write_back

__all__ = ["P2PGroup"]

_MONITOR_TAG = 32000  # (MPI guarantees tags up to 32767)


class P2PGroup(GroupBase):
    """The barriers and point-to-point operations of a process group (see the module
    docstring); not constructed by users."""

    # -- barriers ------------------------------------------------------------------------
    def barrier(self, opts: Any = None) -> Work:
        """Wait for every rank. Past the group's timeout: RuntimeError on this rank (a
        barrier holds no data, so it can be left behind, unlike a data collective)."""
        timeout = self._timeout
        if opts is not None and opts.timeout.total_seconds() > 0:
            timeout = opts.timeout
        self._drain()
        with self._on("barrier") as comm:
            req = comm.Ibarrier()
        if not ops.wait_until(req, timeout.total_seconds()):
            raise RuntimeError(f"barrier on group {self._name!r}: Timed out after "
                               f"{timeout.total_seconds():g} s waiting for the other ranks ")
        return self._done([])

    def monitored_barrier(self, timeout: timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier: rank 0 waits ``timeout`` (default the group's) for
        every other rank and raises RuntimeError naming the first rank that did not arrive
        (every such rank with ``wait_all_ranks``); the others wait for rank 0's release."""
        limit = (self._timeout if timeout is None else timeout).total_seconds()
        rank, n = self._r, self._n
        self._check_live("monitored_barrier")
        self._drain()
        tag = _MONITOR_TAG
        token = torch.zeros(1, dtype=torch.uint8)
        if rank != 0:
            self._comm.Send(spec(token), 0, tag)
            if not ops.wait_until(self._comm.Irecv(spec(token), 0, tag), limit):
                raise RuntimeError(f"Rank {rank} successfully reached monitoredBarrier, but "
                                   f"was not released by rank 0 within {limit:g} s")
            return
        if limit <= 0 and n > 1:
            raise RuntimeError(f"Rank 0 timed out in monitoredBarrier after {limit * 1e3:g} ms")
        tokens = [torch.zeros(1, dtype=torch.uint8) for _ in range(n)]
        reqs = {r: self._comm.Irecv(spec(tokens[r]), r, tag) for r in range(1, n)}
        ops.wait_until(None, limit, pending=reqs)
        late = sorted(r for r, req in reqs.items() if not req.Test())
        if late:
            for r in late:
                reqs[r].Cancel()
                ops.abandon(reqs[r])
            shown = late if wait_all_ranks else late[:1]
            who = "Ranks " + ", ".join(map(str, shown)) if len(shown) > 1 else f"Rank {late[0]}"
            raise RuntimeError(f"{who} failed to pass monitoredBarrier in {limit * 1e3:g} ms")
        for r in range(1, n):
            self._comm.Send(spec(token), r, tag)

    # -- point to point ------------------------------------------------------------------
    def _peer(self, peer: int, what: str, tag: int) -> None:
        if not 0 <= peer < self._n:
            raise ValueError(f"{what}: rank {peer} is outside a group of {self._n}")
        if tag < 0:
            raise ValueError(f"{what}: tag={tag} must be >= 0 for MPI")
        self._check_live(what)

    @handoff("send", (0, 0))
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work:
        t = one_tensor(tensors, "send")
        self._peer(dst, "send", tag)
        src = as_host(t)
        req = self._comm.Isend(spec(src), dst, tag)
        return self._work(Work([t], [req], keep=(src,), what=f"send to {dst}",
                               timeout=self._timeout))

    @handoff("recv", (0, 0))
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work:
        t = one_tensor(tensors, "recv")
        self._peer(src, "recv", tag)
        return self._irecv(t, src, tag, f"recv from {src}")

    @handoff("recv_anysource", (0, 0))
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        t = one_tensor(tensors, "recv")
        self._peer(0, "recv", tag)
        return self._irecv(t, mpi().ANY_SOURCE, tag, "recv from any source")

    def _irecv(self, t: torch.Tensor, src: int, tag: int, what: str) -> Work:
        buf = scratch(t)
        req = self._comm.Irecv(spec(buf), src, tag)
        return self._work(Work([t], [req], finish=lambda: write_back(t, buf), keep=(buf,),
                               what=what, timeout=self._timeout))
