"""In-job recovery of training from a lost rank (MPI's fault tolerance, ULFM).

When a rank dies, every survivor gets :class:`~mpidist.core.failure.ProcessFailure` from its
next MPI call (the hook of :mod:`mpidist.core.failure` revoked every communicator), wherever
it was in the step. :func:`recover`, on every survivor:

0. **Abandon** the asynchronous save in flight, if any
   (:meth:`~mpidist.checkpoint.AsyncCheckpoint.abandon`, no MPI): its communicator is
   revoked, so it can never commit; its writer stops and ``latest`` stays the previous
   checkpoint (the handle reports ``abandoned``).
1. **Shrink and agree**: the survivors' communicator from the run's top one
   (:func:`~mpidist.core.failure.shrink`), and one table of what each survivor reports:
   its completed steps, the step its own snapshot holds, the steps its buddy copy holds.
   The survivors learn of a failure in different calls (one may have finished the step
   that another failed in), so they go on from ``T``, the smallest completed step count:
   every survivor restores the state at the start of step ``T + 1``.
2. **Decide** (:func:`decide`, pure, the same on every survivor): the dead ranks, and
   whether their state is still somewhere: a dead rank's shard must be in the copy of its
   holder (:mod:`mpidist.parallel.redundancy`), which must be alive and hold step ``T+1``.
   If not, every survivor raises the same
   :class:`~mpidist.core.failure.UnrecoverableFailure` (one line; the job ends and the
   supervisor or requeue restarts it from its last checkpoint).
3. **Rebuild**: the model on the survivors (the dp mesh at the new size: batches split
   unevenly as they do at any size), and every shard moved from the old layout to the new
   one with one ``Alltoallv`` per flat buffer, reusing elastic resizing's arithmetic
   (:func:`mpidist.parallel.resize.transfer_plan`), with each dead rank's pieces sent by the
   holder of its copy instead of by it. DDP's replicated state is re-laid-out locally.
4. **Roll back**: the optimizer's step count, its update count, the loss scale and the
   sampler go back to step ``T``; the copies are made anew on the new layout; ULFM's uniform
   agreement (``Agree``) closes the recovery. The caller redoes step ``T + 1``: by the
   world-size invariance of every synchronous strategy the trajectory is the one the run
   would have had without the failure.

Meshes with pipeline or tensor parallelism (and data-parallel meshes whose ranks the mesh
orders otherwise than the run's communicator) take the general path of steps 2-3
(:mod:`mpidist.parallel.regroup`): the dead ranks' state must be in a replica of their
column or in their holder's copy; the survivors choose the mesh they go on with (pp and tp
kept where they are enough, else dropped: :func:`~mpidist.parallel.regroup.choose_mesh`),
gather the whole state as named global tensors (own snapshots and the holders' copies,
matched by mesh coordinates), and the ranks that go on load it into the model rebuilt at the
new (pp, dp, tp) as a checkpoint written at another mesh is loaded. The survivors the new
mesh has no place for are released: their :class:`MeshChanged` has ``released`` set and no
model.

A failure during the recovery itself starts it over from the newest communicator, with
the same sources (the snapshot and the copies of the old layout are kept until the end).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpidist.checkpoint.background import in_flight
from mpidist.core.comms import info, mpi, phase
from mpidist.core.failure import (
    ProcessFailure,
    UnrecoverableFailure,
    commit,
    enabled,
    keep_alive,
    shrink,
)
from mpidist.parallel.hooks import AllReduce, ReduceScatter
from mpidist.parallel.redundancy import checkpoint_names, holder_of
from mpidist.parallel.regroup import assemble, choose_mesh, gather_named, holder_map, uncovered
from mpidist.parallel.resize import transfer_plan

__all__ = ["PHASES", "MeshChanged", "RecoveryMixin", "decide", "lost_words", "off_reason",
           "recover", "redundancy_reason"]

#: the phases a failure is reported in (by their index; others are reported as "")
PHASES = ("", "forward", "backward", "optimizer", "update", "allgather", "agreement",
          "evaluation", "checkpoint", "pipeline", "recovery", "resize")
_RESTART = ("restart from the last checkpoint (the supervisor, --requeue or "
            "mpidist train --resume)")


class MeshChanged(Exception):
    """Raised by :meth:`ShardedOptimizer.step` (at the step boundary) after in-job recovery
    from a lost rank: the mesh changed and the step's batch must be redone.

    ``model`` is the model to train on from now on (a new object, on the survivors);
    ``comm`` the survivors' communicator; ``step`` the steps completed (the optimizer's
    ``step_count``, rolled back: the next step is ``step + 1``, whose batch must be drawn
    again: the optimizer's own sampler was rewound); ``dead`` the world ranks lost;
    ``world_size`` the survivors' number; ``timing`` seconds of detect, shrink (with the
    agreement), rebuild; ``moved_bytes`` what this rank sent to rebuild. ``released``: this
    rank has no place in the new mesh (``model`` and ``comm`` are None): it trains no more
    and waits for the job's end (:func:`~mpidist.core.failure.leave`).
    """

    def __init__(self, model: Any, comm: Any, step: int, dead: list[int], world_size: int,
                 timing: dict[str, float], moved_bytes: int = 0, *,
                 released: bool = False) -> None:
        super().__init__(f"lost rank(s) {dead}: the mesh is now {world_size} rank(s); redo "
                         f"step {step + 1}")
        self.model, self.comm, self.step, self.dead = model, comm, step, dead
        self.world_size, self.timing, self.moved_bytes = world_size, timing, moved_bytes
        self.released = released


def redundancy_reason(opt: Any) -> str | None:
    """Why ``opt``'s strategy cannot keep copies for in-job recovery (None: it can). Pure."""
    model = opt.model
    if not getattr(opt, "supports_recovery", True):
        return f"{type(opt).__name__} changes its membership itself"
    if type(opt.hook) not in (AllReduce, ReduceScatter):
        return (f"the {opt.hook.name} gradient communication keeps per-rank state that has "
                "no copies")
    if model.shard_size != model.dp_size:
        return "sharding over groups smaller than the data-parallel group keeps no copies"
    if not model.device.is_cpu:
        return f"copies are kept in host memory: device {model.device} is not supported yet"
    return None


def off_reason(opt: Any) -> str | None:
    """Why a failure of a rank would end ``opt``'s training (None: it recovers in-job)."""
    if not enabled():
        return "MPI's fault tolerance is off"
    if opt.redundancy is None:
        why = redundancy_reason(opt) if opt.model is not None else None
        return why or "--redundancy none keeps no copies"
    model = opt.model
    if model.dp_size * model.pp_size * model.tp_size < 2:
        return "a single rank has no survivor to go on"
    return None


def lost_words(dead: Sequence[int]) -> str:
    """``rank 2`` or ``ranks 1 and 3``."""
    dead = list(dead)
    if len(dead) == 1:
        return f"rank {dead[0]}"
    return f"ranks {', '.join(map(str, dead[:-1]))} and {dead[-1]}"


@dataclass
class Decision:
    """What the survivors agreed on (identical on every survivor)."""

    step: int  #: T: the steps every survivor completed; the next step is T + 1
    dead: list[int]  #: dead ranks of the data-parallel group
    unrecoverable: str = ""  #: the one line, when the job must end
    holders: dict[int, int] = field(default_factory=dict)  #: dead rank -> its holder


def decide(n: int, survivors: Sequence[int], values: np.ndarray, *, copies: bool,
           off: str | None = None, world: Sequence[int] | None = None,
           stride: int = 1) -> Decision:
    """The survivors' decision from the agreed table. Pure.

    ``n``: the old data-parallel size; ``survivors[i]``: new rank i's old rank;
    ``values[i]``: its (completed steps, the index in :data:`PHASES` of the phase it saw the
    failure in, its own snapshot's step, its copy buffers' steps...); ``copies``: whether
    the level keeps buddy copies (ZeRO); ``off``: why recovery is off (None: on);
    ``world``: the old ranks' world ranks (for the message, which names the phase the
    lowest survivor saw the failure in); ``stride``: the copies'
    (:func:`~mpidist.parallel.redundancy.holder_of`).
    """
    alive = set(survivors)
    dead = [r for r in range(n) if r not in alive]
    done = values[:, 0].astype(np.int64)
    t = int(done.min())
    names = [world[d] if world is not None else d for d in dead]
    code = int(values[0, 1])
    phase = PHASES[code] if 0 <= code < len(PHASES) else ""
    where = f" in step {t + 1}" + (f" ({phase})" if phase else "")
    d = Decision(t, dead)
    if off is not None:
        d.unrecoverable = (f"lost {lost_words(names)}{where}; in-job recovery is off "
                           f"({off}): {_RESTART}")
        return d
    for i, (r, row) in enumerate(zip(survivors, values, strict=True)):
        if row[2] != t + 1 and done[i] != t:  # pragma: no cover - the protocol prevents it
            d.unrecoverable = (f"lost {lost_words(names)}{where}; rank {r} has no snapshot "
                               f"of step {t + 1}: {_RESTART}")
            return d
    if not copies:
        return d
    for r in dead:
        h = holder_of(r, n, stride)
        d.holders[r] = h
        who = world[r] if world is not None else r
        if h not in alive:
            hw = world[h] if world is not None else h
            d.unrecoverable = (f"lost {lost_words(names)}{where}: rank {who} and rank {hw}, "
                               f"which held its copy, died together; in-job recovery is "
                               f"impossible: {_RESTART}")
            return d
        row = values[survivors.index(h)]
        if t + 1 not in row[3:]:
            d.unrecoverable = (f"lost {lost_words(names)}{where}: the copy of rank {who} "
                               f"was not yet refreshed for step {t + 1}; in-job recovery is "
                               f"impossible: {_RESTART}")
            return d
    return d


# -- the recovery ----------------------------------------------------------------------------
class _Old:
    """Everything of the interrupted layout a recovery (and its retries) reads."""

    def __init__(self, opt: Any, failure: ProcessFailure) -> None:
        model = opt.model
        self.opt, self.model, self.state = opt, model, opt.state
        self.red = opt.redundancy
        self.level, self.layout = model.level, model.layout
        self.comm = opt.build_comm
        # (the mesh's ranks are the top communicator's where recovery is on: pp = tp = 1)
        self.n, self.rank = self.comm.Get_size(), self.comm.Get_rank()
        members = info(self.comm).members if info(self.comm) is not None else []
        self.world = members if len(members) == self.n else list(range(self.n))
        self.done = int(opt.step_count)
        self.extras = opt.position_extras()
        self.entry = opt.step_entry
        self.failure = failure
        self.freed = False
        self.newest = self.comm  # the communicator to shrink next
        self.built: list[Any] = []  # models built by failed attempts
        self.pp, self.dp, self.tp = model.pp_size, model.dp_size, model.tp_size
        self.cart_of = self.red.cart_of if self.red is not None else list(range(self.n))
        self.stride = self.red.stride if self.red is not None else 1  # who holds whose copy
        #: the general path (mesh coordinates, named tensors): pp or tp, or a reordered mesh
        self.general = self.pp * self.tp > 1 or self.cart_of != list(range(self.n))
        self.shapes = model.tensor_shapes()
        self.names = checkpoint_names(self.shapes, sorted(self.state.buffers))
        self.dtype = np.dtype(model.dtype)

    def values(self) -> list[int]:
        red = self.red
        tags = red.copy_tag if red is not None else [-1, -1]
        snap = red.snap_tag if red is not None else -1
        phase = self.failure.phase
        return [self.done, PHASES.index(phase) if phase in PHASES else 0, snap, *tags]


def recover(opt: Any, failure: ProcessFailure) -> MeshChanged:
    """Recover ``opt`` from ``failure`` (see the module doc) and return the
    :class:`MeshChanged` to raise or handle. Collective over the survivors of the run's top
    communicator; raises :class:`~mpidist.core.failure.UnrecoverableFailure` (the same on
    every survivor) when the state of a dead rank is lost or recovery is off."""
    t0 = time.time()
    pending = in_flight()  # an asynchronous save cannot commit over revoked communicators
    if pending is not None:
        pending.abandon()  # no MPI: its writer stops, latest stays the previous checkpoint
    old = _Old(opt, failure)
    off = off_reason(opt)
    with phase("recovery"):
        for _ in range(old.n):
            try:
                changed = (_attempt_general if old.general else _attempt)(old, off, t0)
            except ProcessFailure:
                continue  # another rank died meanwhile: start over on the newest comm
            if pending is not None:
                pending.free_communicator()
            return changed
    raise UnrecoverableFailure(f"ranks kept failing during the recovery from {failure}: "
                               f"{_RESTART}")


def _attempt(old: Any, off: str | None, t0: float) -> MeshChanged:
    opt = old.opt
    shrunk = shrink(old.newest, original_size=old.n, original_rank=old.rank,
                    values=old.values())
    old.newest = shrunk.comm
    d = decide(old.n, shrunk.survivors, shrunk.values,
               copies=old.red is not None and old.red.copies, off=off, world=old.world,
               stride=old.stride)
    if d.unrecoverable:
        commit(shrunk.comm)
        raise UnrecoverableFailure(d.unrecoverable)
    t1 = time.time()
    _free_old(old)
    model = opt.rebuild_on(shrunk.comm)
    old.built.append(model)
    state = opt.base.init_state(model.state_size, dtype=model.dtype)
    tag = d.step + 1
    params, own_state, opt_step, extras = old.red.own_at(old.model, old.state, old.extras, tag)
    held = {v: old.red.copy_at(tag) for v in d.holders if d.holders[v] == old.rank}
    moved = _move(shrunk, old, d, model, state, (params, own_state),
                  {v: c[:2] for v, c in held.items() if c is not None})
    timing = _settle(opt, old, shrunk, d, (model, state), (opt_step, extras), (t0, t1))
    dead = [old.world[r] for r in d.dead]
    return MeshChanged(model, shrunk.comm, d.step, dead, shrunk.comm.Get_size(), timing,
                       moved)


def _free_old(old: Any) -> None:
    """The interrupted model's communicators (revoked) and those of failed attempts."""
    if not old.freed:
        old.model.free()  # its communicators are revoked; their memory is all it keeps
        old.freed = True
    for m in old.built:  # models, and the communicators they were built on
        m.free()
    old.built = []


class _Freed:
    """A communicator of a failed attempt, freed with its models."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def free(self) -> None:
        self.comm.Free()


def _lost_line(old: Any, d: Decision, shrunk: Any) -> str:
    """The one line when a dead rank's state is gone on the general path ('' if none)."""
    gone = uncovered(d.dead, shrunk.survivors, shrunk.values, d.step + 1, pp=old.pp,
                     dp=old.dp, tp=old.tp, level=old.level, cart_of=old.cart_of,
                     stride=old.stride)
    if gone is None:
        return ""
    v, h, why = gone
    names = lost_words([old.world[r] for r in d.dead])
    where = f"lost {names} in step {d.step + 1}"
    if h < 0:
        return (f"{where}: no rank of rank {old.world[v]}'s pipeline stage and tensor "
                f"shard survived; in-job recovery is impossible: {_RESTART}")
    if why == "died":
        return (f"{where}: rank {old.world[v]} and rank {old.world[h]}, which held its "
                f"copy, died together; in-job recovery is impossible: {_RESTART}")
    return (f"{where}: the copy of rank {old.world[v]} was not yet refreshed for step "
            f"{d.step + 1}; in-job recovery is impossible: {_RESTART}")


def _attempt_general(old: Any, off: str | None, t0: float) -> MeshChanged:
    """One recovery attempt on the general path (see the module doc). Collective over the
    survivors."""
    opt = old.opt
    shrunk = shrink(old.newest, original_size=old.n, original_rank=old.rank,
                    values=old.values())
    old.newest = shrunk.comm
    d = decide(old.n, shrunk.survivors, shrunk.values, copies=False, off=off, world=old.world)
    d.unrecoverable = d.unrecoverable or _lost_line(old, d, shrunk)
    if d.unrecoverable:
        commit(shrunk.comm)
        raise UnrecoverableFailure(d.unrecoverable)
    t1 = time.time()
    _free_old(old)
    tag, red = d.step + 1, old.red
    params, own_state, opt_step, extras = red.own_at(old.model, old.state, old.extras, tag)
    keys = sorted(own_state)
    sources = [(red.own_manifest(), [params, *(own_state[k] for k in keys)])]
    holders = holder_map(old.pp, old.dp, old.tp, old.level, old.cart_of, old.stride)
    for v in d.dead:
        copy = red.copy_at(tag) if holders.get(v) == old.rank else None
        if copy is not None:
            sources.append((red.peer_manifest, [copy[0], *(copy[1][k] for k in keys)]))
    meta, data, sent = gather_named(shrunk.comm, sources, old.dtype)
    tensors, missing = assemble(old.names, list(old.shapes.values()) * (1 + len(keys)),
                                meta, data)
    if missing:  # pragma: no cover - uncovered() found every dead rank's state
        commit(shrunk.comm)
        raise UnrecoverableFailure(f"lost state of {missing[:3]} in the recovery: {_RESTART}")
    pp, tp, dp = choose_mesh(len(shrunk.survivors), old.pp, old.tp)
    me, used = shrunk.comm.Get_rank(), pp * tp * dp
    comm = shrunk.comm.Split(0 if me < used else mpi().UNDEFINED, me)
    dead = [old.world[r] for r in d.dead]
    if me >= used:  # released: nothing to train
        commit(shrunk.comm)
        return MeshChanged(None, None, d.step, dead, used, {}, sent, released=True)
    old.built.append(_Freed(comm))  # freed if this attempt fails
    model = opt.rebuild_on(comm, pp=pp, tp=tp)
    old.built.append(model)
    state = opt.base.init_state(model.state_size, dtype=model.dtype)
    model.load_full_parameters({n: tensors[f"params/{n}"] for n in old.shapes})
    for k in keys:
        model.load_state_tensors({n: tensors[f"optimizer/{k}/{n}"] for n in old.shapes},
                                 state.buffers[k])
    timing = _settle(opt, old, shrunk, d, (model, state), (opt_step, extras), (t0, t1))
    return MeshChanged(model, comm, d.step, dead, used, timing, sent)


def _settle(opt: Any, old: Any, shrunk: Any, d: Decision, new: tuple[Any, Any],
            position: tuple[int, dict[str, Any]], times: tuple[float, float]
            ) -> dict[str, float]:
    """The end of a recovery attempt, on the rebuilt model and state ``new``: adopt them,
    roll the position back to step ``d.step`` (``position``: the optimizer's step count and
    extras), make the copies anew, commit over the survivors (ULFM ``Agree``). The timing of
    the :class:`MeshChanged` (``times``: the recovery's start and the rebuild's). Collective
    over the survivors."""
    (model, state), (opt_step, extras), (t0, t1) = new, position, times
    opt.adopt(model, state)
    opt.restore_position(opt_step, d.step, None)
    opt.restore_extras(extras)
    opt.rewind_sampler(old.entry, d.step)
    if opt.redundancy is not None:
        opt.redundancy.establish(opt, d.step + 1)
    t2 = time.time()
    commit(shrunk.comm)
    old.built = []
    t3 = time.time()
    return {"detect": max(0.0, t0 - old.failure.detected), "shrink": shrunk.seconds
            + (t3 - t2), "rebuild": t2 - t1, "detected_at": old.failure.detected,
            "recovered_at": t3}


# -- moving the state ---------------------------------------------------------------------------
def _move(shrunk: Any, old: _Old, d: Decision, model: Any, state: Any,
          own: tuple[np.ndarray, dict[str, np.ndarray]],
          held: dict[int, tuple[np.ndarray, dict[str, np.ndarray]]]) -> int:
    """Fill the new model's parameters and ``state`` from this rank's restored state and
    the copies it holds. Collective over the survivors. Returns the bytes sent."""
    new_lay = model.layout
    params, own_state = own
    if old.level == 0:  # everything replicated: every survivor has it all
        _relayout(old.layout, new_lay, params, model.params)
        for k, buf in state.buffers.items():
            _relayout(old.layout, new_lay, own_state[k], buf)
        model.sync_compute_parameters()
        return 0
    move = _Mover(shrunk, old, d, new_lay)
    sent = 0
    if old.level == 3:
        sent += move(params, {v: c[0] for v, c in held.items()}, model.param_shard)
    else:
        shard = np.zeros(new_lay.local_size, dtype=params.dtype)
        sent += move(params, {v: c[0] for v, c in held.items()}, shard)
        for u in range(len(new_lay.units)):
            new_lay.unit_shard_of_full(u, model.params)[:] = new_lay.unit_local(u, shard)
        model.placement.allgather_units(model.params, comm=model.shard_comm)
    for k, buf in state.buffers.items():
        sent += move(own_state[k], {v: c[1][k] for v, c in held.items()}, buf)
    model.sync_compute_parameters()
    return sent


def _relayout(old_lay: Any, new_lay: Any, src: np.ndarray, dst: np.ndarray) -> None:
    """A full-layout buffer in another padding (every unit's elements kept). Local."""
    for a, b in zip(old_lay.units, new_lay.units, strict=True):
        dst[b.full_offset:b.full_offset + b.numel] = src[a.full_offset:a.full_offset + a.numel]


class _Mover:
    """One ``Alltoallv`` per sharded buffer from the old layout (survivors' own shards and
    the dead ranks' copies) to the new one, over the survivors."""

    def __init__(self, shrunk: Any, old: _Old, d: Decision, new_lay: Any) -> None:
        self.comm = shrunk.comm
        self.m, self.me = shrunk.comm.Get_size(), shrunk.comm.Get_rank()
        self.old_lay, self.new_lay, self.n = old.layout, new_lay, old.n
        self.survivors = list(shrunk.survivors)
        new_ranks = [-1] * old.n
        for i, r in enumerate(self.survivors):
            new_ranks[r] = i
        numels = [s.numel for s in old.layout.units]
        old_ranks = list(range(old.n))
        # the old ranks each survivor sends for: its own, then the dead ones it holds
        self.speaks = [[r] + sorted(v for v, h in d.holders.items() if h == r)
                       for r in self.survivors]
        self.sends = {v: transfer_plan(numels, old.n, self.m, old_ranks, new_ranks, v,
                                       sharded=True)[0] for v in self.speaks[self.me]}
        self.recvs = transfer_plan(numels, old.n, self.m, old_ranks, new_ranks,
                                   self.survivors[self.me], sharded=True)[1]

    def __call__(self, own: np.ndarray, held: dict[int, np.ndarray], dst: np.ndarray) -> int:
        src = {self.speaks[self.me][0]: own, **held}
        pieces, scounts = [], np.zeros(self.m, dtype=np.int64)
        for q in range(self.m):
            for v in self.speaks[self.me]:
                for u, a, b in self.sends[v][self.survivors[q]]:
                    span = self.old_lay.units[u]
                    o = span.local_offset + a - v * span.shard
                    pieces.append(src[v][o:o + b - a])
                    scounts[q] += b - a
        rcounts = np.array([sum(b - a for v in self.speaks[p] for _, a, b in self.recvs[v])
                            for p in range(self.m)], dtype=np.int64)
        sendbuf = np.concatenate(pieces) if pieces else np.empty(0, dtype=dst.dtype)
        recvbuf = np.empty(int(rcounts.sum()), dtype=dst.dtype)
        sdispl = np.concatenate([[0], np.cumsum(scounts)[:-1]]).astype(np.int64)
        rdispl = np.concatenate([[0], np.cumsum(rcounts)[:-1]]).astype(np.int64)
        try:
            self.comm.Alltoallv([sendbuf, (scounts.tolist(), sdispl.tolist())],
                                [recvbuf, (rcounts.tolist(), rdispl.tolist())])
        except BaseException:
            keep_alive(sendbuf, recvbuf)  # a failed transfer may still touch them
            raise
        pos = 0
        for p in range(self.m):
            for v in self.speaks[p]:
                for u, a, b in self.recvs[v]:
                    span = self.new_lay.units[u]
                    o = span.local_offset + a - self.me * span.shard
                    dst[o:o + b - a] = recvbuf[pos:pos + b - a]
                    pos += b - a
        return int((scounts.sum() - scounts[self.me]) * dst.dtype.itemsize)


# -- the optimizer's side ---------------------------------------------------------------------
class RecoveryMixin:
    """In-job recovery methods of :class:`~mpidist.parallel.engine.ShardedOptimizer`."""

    # (provided by ShardedOptimizer)
    model: Any
    state: Any
    base: Any
    hook: Any
    config: Any
    shape: Any
    sampler: Any
    scaler: Any
    step_count: int
    build_comm: Any
    redundancy_mode: str | None
    redundancy: Any
    step_entry: tuple[int, int | None]

    def recover(self, failure: ProcessFailure) -> MeshChanged:
        """Recover from ``failure`` (a lost rank, seen by any MPI call of this rank) in the
        job: shrink to the survivors, rebuild the model on them from this rank's snapshot
        and the copies, roll back to the start of the interrupted step (see
        :mod:`mpidist.parallel.recovery`). Returns the :class:`MeshChanged` that
        :meth:`step` raises: train on its ``model`` and redo the step.

        Collective over the survivors of the run's communicator: every survivor must call
        it (each learns of the failure from its own next MPI call). Raises
        :class:`~mpidist.core.failure.UnrecoverableFailure`, the same on every survivor,
        when recovery is off or a dead rank's state is lost."""
        return recover(self, failure)

    def recovery_status(self) -> str:
        """``"on (...)"`` or ``"off: <why>"``: whether a lost rank is recovered in-job."""
        why = off_reason(self)
        if why is not None:
            return f"off: {why}"
        red = self.redundancy
        return (f"on (--redundancy buddy: {red.nbytes():,} bytes of copies per rank, "
                f"{red.bytes_per_step():,} bytes sent per step for them)")

    def setup_redundancy(self) -> None:
        """Make the copies of the attached model where ``redundancy_mode`` asks for them:
        "buddy", or None where MPI's fault tolerance is on (which installs its hook).
        ValueError when "buddy" is asked of a strategy that cannot keep them. Collective
        over the model's data-parallel group (or its mesh, where dp is 1) where copies are
        made: their node map, once (the copies are filled at the first step)."""
        from mpidist.core.failure import enable
        from mpidist.parallel.redundancy import Redundancy

        self.redundancy = None
        mode = self.redundancy_mode
        if mode == "none" or self.model is None:
            return
        why = redundancy_reason(self)
        if mode == "buddy" and why is not None:
            raise ValueError(f"redundancy='buddy': {why}")
        if mode is None and (why is not None or not enable()):
            return
        enable()
        self.redundancy = Redundancy(self)

    def rebuild_on(self, comm: Any, *, pp: int | None = None, tp: int | None = None) -> Any:
        """The model rebuilt on ``comm`` (every rank of it: the survivors), the same
        strategy with pipeline and tensor-parallel sizes ``pp`` and ``tp`` (default: the
        current ones) and the data-parallel size that leaves, without initial values (the
        state is moved in). Collective over ``comm``."""
        from mpidist.parallel.model import resolve_mesh_shape

        module, seed = self.model.module, self.model.seed
        self.build_comm = comm
        self.config = self.config.replace(mesh=None)
        pp = self.shape.pp if pp is None else pp
        tp = self.shape.tp if tp is None else tp
        self.shape = resolve_mesh_shape(self.config, comm, pp, tp, -1)
        return self._build_model(module, seed=seed, initialize=False)  # type: ignore[attr-defined]

    def adopt(self, model: Any, state: Any, *, copies: bool = True) -> None:
        """Train ``model`` with optimizer ``state`` from now on (after a recovery); its
        copies are made for its layout unless ``copies`` is False (a failed join puts back
        the pre-join model, whose communicators are freed, and its copies as they were).
        Not collective."""
        self.model, self.state = model, state
        self.hook = model.hook
        self.hook.opt = self
        self._bind_pieces()  # type: ignore[attr-defined]
        if copies:
            self.setup_redundancy()

    def position_extras(self) -> dict[str, Any]:
        """What a rollback restores besides the state and the step count: fp16's loss
        scale."""
        return {} if self.scaler is None else {"scaler": self.scaler.state_dict()}

    def restore_extras(self, extras: dict[str, Any]) -> None:
        """Put :meth:`position_extras` back."""
        if self.scaler is not None and "scaler" in extras:
            self.scaler.load_state_dict(extras["scaler"])

    def rewind_sampler(self, entry: tuple[int, int | None], step: int) -> None:
        """Put the optimizer's sampler where step ``step + 1`` draws its batch. ``entry``:
        (step count, sampler position) when the last :meth:`step` began (the batch of step
        ``count + 1`` was drawn just before, at position - 1)."""
        count, position = entry
        if self.sampler is not None and position is not None:
            self.sampler.step = position - 1 - count + step
