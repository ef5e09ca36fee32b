"""The copies in-job recovery restores from (``--redundancy buddy``).

A rank that dies takes its part of the training state with it; the survivors roll back to
the state at the start of the interrupted step and redo it (:mod:`mpidist.parallel.recovery`).
Two kinds of copies make that possible, both in host memory:

* **The rank's own snapshot** of what the update changes (every level): taken after the
  gradients are synchronised and before anything is updated, so that a survivor that had
  already updated when it learned of the failure can go back. DDP (level 0) keeps the whole
  parameters and optimizer state, ZeRO its shard of them. The step's gradients need no copy:
  the redo computes them again.
* **A buddy's copy** of a neighbour's shard (ZeRO-1/2/3: the optimizer state, the
  parameters' shard): rank ``r`` of the data-parallel group holds the copy of rank
  ``(r - s) mod n``, ``s`` the group's *stride* (:func:`copy_stride`): 1 on one node; where
  the group spans nodes, the smallest step that lands every rank on another node than its
  own (ranks placed node by node, k per node: ``s = k``, the same local index on the next
  node), so that a node lost whole leaves every copy of its ranks alive. DDP needs none
  (every survivor has everything).

The buddy's copy is refreshed every step without sending the state: after its own update,
the holder applies the same fused update (the same kernel, learning rate, gradient scale and
step count: bitwise the neighbour's result) to its copy, with the neighbour's reduced
gradient. ZeRO-1 allreduces the whole gradient, so it has it already (no bytes); ZeRO-2/3
reduce-scatter, and each rank sends its gradient shard to its holder (one message of
``shard`` elements a step, started as soon as the gradients are synchronised, so that it
travels during the clipping and the own update). Sending the updated state instead would
cost ``(state buffers + 1) x shard`` elements a step (three times as much with AdamW).

**Meshes with pipeline or tensor parallelism.** A (stage, tp rank) column whose data-parallel
group has two ranks or more keeps the copies above inside that group (DDP: a replica of the
column has everything; ZeRO: the buddy's copy). Where ``dp == 1`` (e.g. pp2 x tp2 on 4 ranks)
nothing of a column is anywhere else, so every rank's whole local state (its parameters in
the snapshot's layout, its optimizer state, its step) is held by the next rank of the mesh
(``(r + s) mod n`` in the mesh's own order, which is in another column), refreshed after
every update by sending the updated state: ``(1 + state buffers) x local`` elements and the
step each step (AdamW: three times the rank's parameters; replaying is impossible, the
holder does not have the other column's gradients).

With each copy the holder keeps its owner's *manifest*, exchanged when the copies are made:
which elements of which named global tensor (checkpoint names: ``params/<name>``,
``optimizer/<state>/<name>``) each range of the owner's buffers is. A recovery onto another
mesh reads the copies through it (:mod:`mpidist.parallel.regroup`).

The copy is double-buffered, each buffer tagged with the step whose start it holds: the
refresh of step ``s`` writes the buffer of ``s + 1`` from that of ``s``, so a failure during
a refresh leaves the previous copy whole, and a holder that finished one step more than
another survivor still has the copy the recovery asks for. After a start, a checkpoint load
or a recovery the copies are made anew by one ring exchange of the shards
(:meth:`Redundancy.establish`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpidist.core import collectives as C
from mpidist.core.failure import keep_alive
from mpidist.core.topology import topology
from mpidist.optim.base import OptimizerState
from mpidist.parallel.regroup import mesh_ranks

__all__ = ["MODES", "Redundancy", "checkpoint_names", "copy_bytes_per_step", "copy_stride",
           "holder_of",
           "manifest"]

#: the values of ``--redundancy``
MODES = ("buddy", "none")
_TAG = 0x4D44  # the point-to-point tag of the copies' messages on the data-parallel group


def holder_of(rank: int, n: int, stride: int = 1) -> int:
    """The rank of a group of ``n`` that holds ``rank``'s copy (``stride``:
    :func:`copy_stride` of the group). Pure."""
    return (rank + stride) % n


def copy_stride(nodes: Sequence[int]) -> int:
    """The smallest ``s`` in ``1 .. n-1`` such that rank ``(r + s) mod n`` is on another
    node than rank ``r`` for every rank ``r`` of a group (``nodes[r]``: the node of rank
    ``r``); 1 where there is none (one node, or nodes the ring cannot separate). Pure:
    the same on every rank that has the same node map."""
    n = len(nodes)
    if n < 2 or len(set(nodes)) < 2:
        return 1
    for s in range(1, n):
        if all(nodes[(r + s) % n] != nodes[r] for r in range(n)):
            return s
    return 1


def copy_bytes_per_step(level: int, shard_elements: int, itemsize: int) -> int:
    """Bytes each rank sends a step to keep its copy fresh: its gradient shard at ZeRO-2/3,
    nothing at DDP and ZeRO-1 (whole gradients: the holder has the neighbour's). Pure."""
    return shard_elements * itemsize if level >= 2 else 0


def manifest(placement: Any, params_size: int, state_sizes: dict[str, int],
             sharded: bool) -> np.ndarray:
    """Where every element of a rank's snapshot-layout buffers goes in the global named
    tensors: int64 rows ``(name index, start, stop, buffer, offset)``: elements
    ``[start, stop)`` of the flat global tensor ``checkpoint_names(...)[name index]`` are
    ``buffers[buffer][offset:offset + stop - start]`` (buffer 0: the parameters; 1 + i:
    the i-th state buffer in sorted order). ``sharded``: whether the buffers are the
    rank's shards (levels >= 1) or full layouts (level 0). Pure."""
    keys = sorted(state_sizes)
    names = checkpoint_names(placement.global_shapes, keys)
    index = {n: i for i, n in enumerate(names)}
    buffers = {"params/": 0, **{f"optimizer/{k}/": 1 + i for i, k in enumerate(keys)}}
    pieces = placement.checkpoint_pieces(
        np.arange(params_size, dtype=np.int64),
        {k: np.arange(state_sizes[k], dtype=np.int64) for k in keys}, for_writing=False,
        params_sharded=sharded, state_sharded=sharded)
    rows = np.empty((len(pieces), 5), dtype=np.int64)
    for i, (name, ts, data) in enumerate(pieces):
        prefix = name[:name.index("/") + 1] if name.startswith("params/") \
            else name[:name.index("/", len("optimizer/")) + 1]
        rows[i] = (index[name], ts.start, ts.stop, buffers[prefix],
                   int(data[0]) if data.size else 0)
    return rows


def checkpoint_names(shapes: dict[str, Any], keys: list[str]) -> list[str]:
    """The named global tensors of a model's training state, in a fixed order (the
    parameters', then every state buffer's, as checkpoints name them). Pure."""
    return [f"params/{n}" for n in shapes] + [f"optimizer/{k}/{n}" for k in sorted(keys)
                                              for n in shapes]


class Redundancy:
    """The snapshot and buddy copies of one rank for one model (see the module doc).

    Made by the optimizer when its model is attached (collective over the group the copies
    ring over the first time: its node map, :func:`mpidist.core.topology.topology`);
    ``tag`` values are step numbers: a buffer tagged ``s`` holds the state at the start of
    step ``s`` (after ``s - 1`` steps).
    """

    def __init__(self, opt: Any) -> None:
        model = opt.model
        self.level = model.level
        self.layout = model.layout
        self.placement = model.placement
        #: dp == 1 on a mesh with pp or tp: the next rank of the mesh holds the whole state
        self.cross = model.dp_size == 1 and (model.pp_size > 1 or model.tp_size > 1)
        self.comm = model.mesh.comm if self.cross else model.comm
        #: the mesh rank of every rank of the run's communicator (recovery matches by it)
        self.cart_of = mesh_ranks(opt.build_comm, model.mesh.comm)
        self.n, self.rank = self.comm.Get_size(), self.comm.Get_rank()
        #: the holder of this rank's copy is ``(rank + stride) mod n`` (:func:`copy_stride`:
        #: node-aware where the copies ring over the whole mesh; 1 inside the columns of a
        #: mesh with pp or tp, whose dp groups may lie otherwise on the nodes)
        whole = self.cross or model.pp_size * model.tp_size == 1
        self.stride = copy_stride(topology(self.comm).map.nodes) \
            if whole and self.n > 1 else 1
        self.dtype = np.dtype(model.dtype)
        keys = sorted(opt.state.buffers)
        size = self.layout.full_size if self.level == 0 else self.layout.local_size
        self.snap_params = np.zeros(size, dtype=self.dtype)
        self.snap_state = {k: np.zeros(opt.state.buffers[k].size, dtype=self.dtype) for k in keys}
        self.snap_tag = -1
        self.snap_step = 0
        self.snap_extra: dict[str, Any] = {}
        self.copies = self.cross or (self.level >= 1 and self.n > 1)
        local = self.layout.local_size if self.copies and not self.cross else 0
        self.copy_params = [np.zeros(local, dtype=self.dtype) for _ in range(2)]
        self.copy_state = [{k: np.zeros(local, dtype=self.dtype) for k in keys}
                           for _ in range(2)]
        self.copy_tag = [-1, -1]
        self.copy_step = [0, 0]
        self.grad_in = np.zeros(local if self.level >= 2 else 0, dtype=self.dtype)
        self._pending: Any = None  # the gradient shard's messages in flight
        #: how the copy follows the neighbour: "replay" its update (the default), or "send"
        #: the updated state each step (kept to measure the choice: benchmarks/recovery.py)
        self.refresh = "send" if self.cross else "replay"
        #: the neighbour's manifest (:func:`manifest`), from :meth:`establish`
        self.peer_manifest = np.zeros((0, 5), dtype=np.int64)
        self._sizes = [self.snap_params.size] + [self.snap_state[k].size for k in keys]
        self._peer_sizes = list(self._sizes) if not self.cross else [0] * len(self._sizes)

    # -- who holds what ----------------------------------------------------------------------
    @property
    def neighbour(self) -> int:
        """The rank whose copy this rank holds."""
        return (self.rank - self.stride) % self.n

    @property
    def holder(self) -> int:
        """The rank that holds this rank's copy."""
        return holder_of(self.rank, self.n, self.stride)

    def nbytes(self) -> int:
        """Host bytes of the snapshot and the copies on this rank (``cross``: before the
        copies are first made, whose size is the neighbour's, this rank's own size counts
        for them)."""
        arrays = [self.snap_params, *self.snap_state.values(), *self.copy_params,
                  *(a for d in self.copy_state for a in d.values()), self.grad_in]
        own = int(sum(a.nbytes for a in arrays))
        if self.cross and not any(self._peer_sizes):
            own += 2 * sum(self._sizes) * self.dtype.itemsize
        return own

    def bytes_per_step(self) -> int:
        """Bytes this rank sends a step for its copy (:func:`copy_bytes_per_step`)."""
        if not self.copies:
            return 0
        if self.refresh == "send":
            return (sum(self._sizes) + 1) * self.dtype.itemsize
        return copy_bytes_per_step(self.level, self.layout.local_size, self.dtype.itemsize)

    def invalidate(self) -> None:
        """The state was replaced (a load): the copies are made anew before the next step."""
        self.copy_tag = [-1, -1]
        self.snap_tag = -1

    # -- own shard in the local layout --------------------------------------------------------
    def _own_params(self, model: Any, out: np.ndarray) -> None:
        """This rank's parameters as the snapshot keeps them (copied into ``out``)."""
        if self.level == 0:
            out[:] = model.params
        elif self.level == 3:
            out[:] = model.param_shard
        else:
            for u in range(len(self.layout.units)):
                self.layout.unit_local(u, out)[:] = self.layout.unit_shard_of_full(
                    u, model.params)

    # -- every step ---------------------------------------------------------------------------
    def before_update(self, opt: Any, tag: int) -> None:
        """After the gradient sync of step ``tag``, before anything is updated: the own
        snapshot, and (ZeRO-2/3) the gradient shard sent to this rank's holder. Starts
        point-to-point messages on the data-parallel group."""
        model = opt.model
        self._own_params(model, self.snap_params)
        for k, buf in opt.state.buffers.items():
            self.snap_state[k][:] = buf
        self.snap_step = int(opt.state.step)
        self.snap_extra = opt.position_extras()
        self.snap_tag = tag
        if self.copies and self.level >= 2 and self.refresh == "replay":
            # (a request that never completes keeps its buffers: a failed one must)
            self._pending = C.Request(
                [self.comm.Irecv(self.grad_in, source=self.neighbour, tag=_TAG),
                 self.comm.Isend(model.grad_shard, dest=self.holder,
                                 tag=_TAG)], self.grad_in, keep=(model.grad_shard,))

    def after_update(self, opt: Any, tag: int, scale: float, skipped: bool) -> None:
        """After the own update of step ``tag``: the neighbour's copy of step ``tag + 1``,
        by the same update applied to the copy of ``tag`` (waits for the gradient shard)."""
        if not self.copies:
            return
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        src = self.copy_tag.index(tag) if tag in self.copy_tag else -1
        if src < 0:
            raise RuntimeError(f"buddy copy of step {tag} missing on dp rank {self.rank} "
                               f"(tags {self.copy_tag}): establish() was not called")
        dst = 1 - src
        if self.refresh == "send":
            self._exchange(opt, tag + 1, dst)
            return
        self.copy_params[dst][:] = self.copy_params[src]
        for k, buf in self.copy_state[src].items():
            self.copy_state[dst][k][:] = buf
        step = self.copy_step[src]
        if not skipped:
            lr = opt.lr()
            pieces = self._neighbour_pieces(opt.model, dst, step)
            for p, g, st in pieces:
                opt.base.update(p, g, st, grad_scale=scale, lr=lr)
            step = pieces[0][2].step if pieces else step + 1
        self.copy_step[dst] = int(step)
        self.copy_tag[dst] = tag + 1

    def _neighbour_pieces(self, model: Any, b: int, step: int
                          ) -> list[tuple[np.ndarray, np.ndarray, OptimizerState]]:
        """The neighbour's update pieces over copy buffer ``b`` (as its own update cut
        them: one per unit at ZeRO-1/2, one at ZeRO-3)."""
        lay, v = self.layout, self.neighbour
        params, state = self.copy_params[b], self.copy_state[b]
        if self.level == 3:
            return [(params, self.grad_in, OptimizerState(step, dict(state)))]
        out = []
        for u, span in enumerate(lay.units):
            sl = slice(span.local_offset, span.local_offset + span.shard)
            g = lay.unit_shard_of_full(u, model.grads, rank=v) if self.level == 1 \
                else self.grad_in[sl]
            out.append((params[sl], g, OptimizerState(step, {k: a[sl] for k, a in
                                                             state.items()})))
        return out

    # -- (re)making the copies ------------------------------------------------------------------
    def ready(self, opt: Any, tag: int) -> bool:
        """Whether the copies hold the start of step ``tag`` (else :meth:`establish`)."""
        return not self.copies or tag in self.copy_tag

    def establish(self, opt: Any, tag: int) -> None:
        """Make the neighbour's copy from its live state, as the start of step ``tag``: one
        ring exchange of (parameter shard, state shards, step), after one of the
        manifests. Collective over the data-parallel group (``cross``: over the mesh)."""
        if not self.copies:
            return
        self._exchange_manifest(opt)
        b = 0 if self.copy_tag[0] < self.copy_tag[1] else 1
        self._exchange(opt, tag, b)
        self.copy_tag[1 - b] = -1

    def _ring(self, send: np.ndarray, recv: np.ndarray) -> None:
        """``send`` to the holder, ``recv`` from the neighbour (a ring ``Sendrecv``)."""
        try:
            self.comm.Sendrecv(send, dest=self.holder, sendtag=_TAG,
                               recvbuf=recv, source=self.neighbour, recvtag=_TAG)
        except BaseException:
            keep_alive(send, recv)  # a failed transfer may still touch them
            raise

    def own_manifest(self) -> np.ndarray:
        """The :func:`manifest` of this rank's snapshot-layout buffers (the parameters,
        then the state buffers in sorted order). Pure."""
        keys = sorted(self.snap_state)
        return manifest(self.placement, self._sizes[0],
                        dict(zip(keys, self._sizes[1:], strict=True)), self.level >= 1)

    def _exchange_manifest(self, opt: Any) -> None:
        """The neighbour's buffer sizes and :func:`manifest` (its copy buffers sized
        after them). Collective like :meth:`establish`."""
        keys = sorted(opt.state.buffers)
        mine = self.own_manifest()
        head = np.array([*self._sizes, mine.shape[0]], dtype=np.int64)
        peer = np.empty_like(head)
        self._ring(head, peer)
        rows = np.empty((int(peer[-1]), 5), dtype=np.int64)
        self._ring(mine, rows)
        self.peer_manifest = rows
        sizes = [int(v) for v in peer[:-1]]
        if sizes != self._peer_sizes:
            self._peer_sizes = sizes
            self.copy_params = [np.zeros(sizes[0], dtype=self.dtype) for _ in range(2)]
            self.copy_state = [{k: np.zeros(s, dtype=self.dtype) for k, s in
                                zip(keys, sizes[1:], strict=True)} for _ in range(2)]
            self.copy_tag = [-1, -1]

    def _exchange(self, opt: Any, tag: int, b: int) -> None:
        """The neighbour's live state into copy buffer ``b``, tagged ``tag``; this rank's to
        its holder. Collective over the data-parallel group (``cross``: the mesh)."""
        model = opt.model
        keys = sorted(opt.state.buffers)
        cuts = np.cumsum([0, *self._sizes])
        send = np.empty(int(cuts[-1]) + 1, dtype=self.dtype)
        self._own_params(model, send[:cuts[1]])
        for i, k in enumerate(keys):
            send[cuts[1 + i]:cuts[2 + i]] = opt.state.buffers[k]
        send[-1] = opt.state.step
        peer = np.cumsum([0, *self._peer_sizes])
        recv = np.empty(int(peer[-1]) + 1, dtype=self.dtype)
        self._ring(send, recv)
        self.copy_params[b][:] = recv[:peer[1]]
        for i, k in enumerate(keys):
            self.copy_state[b][k][:] = recv[peer[1 + i]:peer[2 + i]]
        self.copy_step[b] = int(recv[-1])
        self.copy_tag[b] = tag

    # -- what a recovery restores from ----------------------------------------------------------
    def own_at(self, model: Any, state: Any, extras: dict[str, Any], tag: int
               ) -> tuple[np.ndarray, dict[str, np.ndarray], int, dict[str, Any]]:
        """This rank's own (parameters, state, optimizer step, extras) at the start of step
        ``tag``: the snapshot when it was taken in that step, else the live ``model``,
        ``state`` and ``extras`` (this rank did not reach the update of step ``tag``).
        Parameters in the snapshot's layout (level 0: full; else the local shard)."""
        if self.snap_tag == tag:
            return self.snap_params, self.snap_state, self.snap_step, self.snap_extra
        params = np.empty_like(self.snap_params)
        self._own_params(model, params)
        return params, dict(state.buffers), int(state.step), extras

    def copy_at(self, tag: int) -> tuple[np.ndarray, dict[str, np.ndarray], int] | None:
        """The neighbour's (parameter shard, state shards, optimizer step) at the start of
        step ``tag``, or None when this rank has no such copy."""
        if not self.copies or tag not in self.copy_tag:
            return None
        b = self.copy_tag.index(tag)
        return self.copy_params[b], self.copy_state[b], self.copy_step[b]
