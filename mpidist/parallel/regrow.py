"""Growing back after in-job recovery: replacements spawned and merged at a step boundary.

In-job recovery (:mod:`mpidist.parallel.recovery`) leaves the job smaller: the survivors of
a lost rank shrink, rebuild and go on. Growing back brings the job to its size again,
without a checkpoint and without restarting anyone:

1. **Spawn and merge.** At a step boundary the survivors (every rank of the optimizer's
   communicator) ``Spawn`` the missing processes (the same program: ``sys.executable`` with
   ``sys.orig_argv``, as elastic resizing's joiners) and ``Merge`` with them; the survivors
   keep their ranks, the newcomers follow (:func:`grow` on the survivors, :func:`join` in
   the newcomers, which notice their parent communicator).
2. **State from the survivors, not from disk.** Rank 0 sends the position (the step count,
   the optimizer's update count, the sampler's state, fp16's loss scale, and what the
   caller adds: a run's own counters) as one JSON broadcast; the model is built at the new
   data-parallel size on the merged communicator and the parameters and optimizer state move
   from the survivors' layout to the new one with one ``Alltoallv`` per flat buffer
   (:func:`mpidist.parallel.elastic.move_all`, elastic resizing's arithmetic).
3. **Copies anew.** The buddy copies of in-job recovery
   (:mod:`mpidist.parallel.redundancy`) are made for the grown mesh (one ring exchange).
4. **Commit.** ULFM's uniform agreement (``Agree``) over the grown communicator closes the
   join: from then on it is the job's communicator.

The global batch does not change, and by the world-size invariance of the synchronous
strategies the trajectory is the one without the failure.

**A failure during the join** (a survivor or a newcomer lost during the spawn, the merge,
the transfer, the copies or the agreement) is seen by every survivor as a
:class:`~mpidist.core.failure.ProcessFailure`: :func:`grow` puts the optimizer back on the
pre-join model, state, copies and communicator (the survivors' old buffers are not touched
by the join) and raises it again; the caller's in-job recovery then shrinks the pre-join
communicator and goes on from the pre-join state (nothing is redone: the join sits between
two steps). Newcomers of an abandoned join get :class:`JoinAbandoned` and should exit.

When to grow is the caller's choice; :func:`joins_wanted` is the rule ``mpidist train``
uses (pure, the same on every rank): up to the size the job started with, or a smaller
target, never in the last step, and after a failed join only after a back-off of
``2 ** failures`` steps, at most :data:`MAX_TRIES` failed joins in a run.

Only data-parallel meshes (ddp, ZeRO-1/2/3 with their synchronous hooks, pp = tp = 1) grow
back; they are those in-job recovery recovers.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpidist.checkpoint.background import wait_in_flight
from mpidist.core.calls import set_step
from mpidist.core.comms import bcast_json, mpi, phase, traced
from mpidist.core.failure import ProcessFailure, commit, revoke_all
from mpidist.parallel.elastic import joined_state, move_all
from mpidist.parallel.model import ShardedModel, resolve_mesh_shape
from mpidist.parallel.resize import ResizeDecision

__all__ = ["MAX_TRIES", "MODES", "GrowRefused", "Grown", "JoinAbandoned", "Joined", "build_model",
           "grow", "is_newcomer", "join", "joins_wanted", "next_try", "spawn_args"]

#: failed joins after which a run stops trying to grow back
MAX_TRIES = 3
#: the values of ``mpidist train --regrow``: spawn replacements, or go on smaller
MODES = ("spawn", "none")


# -- when ---------------------------------------------------------------------------------------
def joins_wanted(size: int, start: int, target: int, step: int, steps: int, *,
                 failures: int = 0, retry_at: int = 0, max_tries: int = MAX_TRIES) -> int:
    """How many processes to spawn at the boundary after step ``step``. Pure.

    ``size``: the ranks now; ``start``: the ranks the job started with; ``target``: a size
    asked for (``<out>/elastic-target``; 0: none), which caps the growth (it never goes
    above ``start``); ``steps``: the run's last step (no growing after it); ``failures``:
    the joins that failed so far, ``retry_at``: the first step boundary at which the next
    try may happen (:func:`next_try`); after ``max_tries`` failures, never again.
    """
    cap = min(start, target) if target > 0 else start
    if size >= cap or step >= steps or failures >= max_tries or step < retry_at:
        return 0
    return cap - size


def next_try(step: int, failures: int) -> int:
    """The first step boundary at which a join may be tried again after the ``failures``-th
    failed one at the boundary after step ``step``: ``step + 2 ** failures``. Pure."""
    return step + 2 ** max(0, failures)


def spawn_args() -> list[str]:
    """What the newcomers run after ``sys.executable``: this process's own arguments."""
    return list(getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:])


def is_newcomer() -> bool:
    """Whether this process was spawned into a running job (it has a parent communicator).
    Not collective."""
    return mpi().Comm.Get_parent() != mpi().COMM_NULL


class GrowRefused(RuntimeError):
    """``Spawn`` failed without a lost process (no slots, no executable): nothing changed,
    training goes on at the current size."""


class JoinAbandoned(RuntimeError):
    """In a newcomer: a process was lost during the join; the survivors went back to their
    pre-join mesh, and this process should exit."""


@dataclass
class Grown:
    """What :func:`grow` did (on a survivor): the grown communicator and model, the
    processes joined, and the seconds of each part (``spawn``: Spawn and Merge;
    ``transfer``: metadata, model, state; ``copies``; ``commit``; ``stall``: all of it,
    the time training stood still for the join), and the bytes this rank sent."""

    comm: Any
    model: ShardedModel
    joined: int
    seconds: dict[str, float] = field(default_factory=dict)
    moved_bytes: int = 0


@dataclass
class Joined:
    """What :func:`join` did (in a newcomer): the grown communicator and model, and the
    metadata rank 0 sent (the position, and what the caller of :func:`grow` added)."""

    comm: Any
    model: ShardedModel
    meta: dict[str, Any]
    seconds: float = 0.0


# -- how ----------------------------------------------------------------------------------------
def build_model(opt: Any, module: Any, seed: int, comm: Any) -> ShardedModel:
    """``opt``'s strategy on every rank of ``comm`` (a data-parallel mesh), without initial
    values (the state is moved in); ``opt`` builds its meshes on ``comm`` from now on. The
    same construction as :meth:`~mpidist.parallel.engine.ShardedOptimizer.rebuild_on`, also
    where the optimizer has no model yet (a newcomer). Collective over ``comm``."""
    opt.build_comm = comm
    opt.config = opt.config.replace(mesh=None)
    opt.shape = resolve_mesh_shape(opt.config, comm, 1, 1, -1)
    return ShardedModel(module, opt.config, seed=seed, level=opt.level, hook=opt.hook,
                        balance=opt.balance, comm=comm, tp_plan=opt.tp_plan,
                        initialize=False, pipeline_parallel_size=1, tensor_parallel_size=1,
                        data_parallel_size=opt.shape.dp)


def mesh_positions(union: Any, old: ShardedModel | None,
                   new: ShardedModel) -> tuple[list[int], list[int]]:
    """Each member of ``union``'s data-parallel rank in the pre-join mesh (-1: a newcomer)
    and in the grown one. A mesh orders its ranks by node, so across nodes a rank of the
    mesh need not be the member's rank in ``union`` (a newcomer placed on the first node
    comes before the second node's survivors). Collective over ``union``."""
    mine = np.array([-1 if old is None else old.dp_rank, new.dp_rank], dtype=np.int64)
    table = np.zeros((union.Get_size(), 2), dtype=np.int64)
    union.Allgather(mine, table)
    return [int(v) for v in table[:, 0]], [int(v) for v in table[:, 1]]


def _metadata(opt: Any, n_old: int) -> dict[str, Any]:
    model, state = opt.model, opt.state
    return {"strategy": opt.strategy, "level": int(opt.level),
            "shapes": {n: list(s) for n, s in model.tensor_shapes().items()},
            "state_keys": sorted(state.buffers), "n_old": int(n_old),
            "step": int(state.step), "steps_taken": int(opt.step_count),
            "data": None if opt.sampler is None else opt.sampler.state_dict(),
            "extras": opt.position_extras()}


def _as_failure(exc: Any, where: str) -> ProcessFailure:
    """An MPI error of the join that is not a lost-process class (Open MPI reports a
    process lost in a collective over the survivors and the newcomers as ``MPI_ERR_OTHER``
    to some members) as a lost process: every communicator is revoked, so that every
    survivor leaves the join and recovers."""
    revoke_all()
    return ProcessFailure(f"the join failed: {exc.Get_error_string()}", phase=where,
                          error_class=exc.Get_error_class())


class _Saved:
    """The survivors' pre-join optimizer fields, put back when the join fails."""

    def __init__(self, opt: Any) -> None:
        self.fields = {k: getattr(opt, k) for k in ("model", "state", "redundancy",
                                                     "build_comm", "shape", "config")}

    def restore(self, opt: Any) -> None:
        f = self.fields
        opt.build_comm, opt.shape, opt.config = f["build_comm"], f["shape"], f["config"]
        if opt.model is not f["model"]:  # rebinds the update pieces to the old state
            opt.adopt(f["model"], f["state"], copies=False)
        opt.redundancy = f["redundancy"]  # the pre-join copies: what the recovery reads


def grow(opt: Any, joins: int, extra: dict[str, Any] | None = None, *,
         command: str | None = None, args: Sequence[str] | None = None) -> Grown:
    """Spawn ``joins`` processes and continue on the grown mesh (see the module doc).
    Collective over ``opt.build_comm`` (every survivor) and, from the ``Merge`` on, with the
    newcomers in :func:`join`. ``extra``: JSON-serialisable values every newcomer receives
    (:attr:`Joined.meta`). Call between steps.

    Raises :class:`~mpidist.core.failure.ProcessFailure` (after putting the optimizer back
    on its pre-join model, state, copies and communicator) when a process is lost during
    the join: recover from it as from any lost rank. Raises :class:`GrowRefused` when the
    spawn itself fails; nothing changed then.
    """
    MPI = mpi()
    old_comm = opt.build_comm
    n_old = old_comm.Get_size()
    saved = _Saved(opt)
    wait_in_flight(opt.step_count)  # a save in flight commits over the pre-join ranks
    t0 = time.perf_counter()
    try:
        with phase("grow"):
            try:
                inter = old_comm.Spawn(command or sys.executable,
                                       list(args) if args is not None else spawn_args(),
                                       maxprocs=int(joins), root=0)
            except MPI.Exception as exc:
                raise GrowRefused(f"spawning {joins} process(es) failed: "
                                  f"{exc.Get_error_string()}") from exc
            union = traced(inter.Merge(high=False))
            inter.Disconnect()
            t1 = time.perf_counter()
            bcast_json({**_metadata(opt, n_old), **(extra or {})}, union)
            old_model, old_state = opt.model, opt.state
            old_model.free()  # its communicators; its buffers stay for the transfer
            model = build_model(opt, old_model.module, old_model.seed, union)
            state = opt.base.init_state(model.state_size, dtype=model.dtype)
            d = ResizeDecision(n_old, (), int(joins))
            moved = move_all(union, d, union.Get_rank(), (old_model, old_state),
                             (model, state), ranks=mesh_positions(union, old_model, model))
            state.step = old_state.step
            opt.adopt(model, state)
            t2 = time.perf_counter()
            if opt.redundancy is not None:
                opt.redundancy.establish(opt, opt.step_count + 1)
            t3 = time.perf_counter()
            commit(union)  # uniform: the join is done everywhere, or failed everywhere
    except ProcessFailure:
        saved.restore(opt)
        raise
    except MPI.Exception as exc:  # (a collective over both jobs may fail with another class)
        saved.restore(opt)
        raise _as_failure(exc, "grow") from exc
    t4 = time.perf_counter()
    return Grown(union, model, int(joins), {"spawn": t1 - t0, "transfer": t2 - t1,
                                            "copies": t3 - t2, "commit": t4 - t3,
                                            "stall": t4 - t0}, moved)


def join(opt: Any, module: Any, *, seed: int = 0) -> Joined:
    """In a spawned newcomer: join the running job (collective with the survivors in
    :func:`grow`) and return the grown communicator and model, with ``opt`` at the job's
    position (its sampler, if set, too; else the position is kept for the first one set).

    Raises ValueError when the job runs another strategy or model (a wrong program was
    spawned), and :class:`JoinAbandoned` when a process was lost during the join (the
    survivors went back to their pre-join mesh): exit then.
    """
    MPI = mpi()
    t0 = time.perf_counter()
    parent = traced(MPI.Comm.Get_parent())
    try:
        with phase("join"):
            union = traced(parent.Merge(high=True))
            parent.Disconnect()
            meta = bcast_json(None, union)
            set_step(int(meta["steps_taken"]))  # what this process's calls record
            if meta["strategy"] != opt.strategy or int(meta["level"]) != opt.level:
                raise ValueError(f"joining a {meta['strategy']!r} job as {opt.strategy!r}")
            model = build_model(opt, module, seed, union)
            state = joined_state(opt.base, model, meta)
            n_old = int(meta["n_old"])
            d = ResizeDecision(n_old, (), union.Get_size() - n_old)
            move_all(union, d, union.Get_rank(), None, (model, state),
                     ranks=mesh_positions(union, None, model))
            opt.adopt(model, state)
            opt.restore_position(int(meta["step"]), int(meta["steps_taken"]), meta["data"])
            opt.restore_extras(meta.get("extras") or {})
            if opt.redundancy is not None:
                opt.redundancy.establish(opt, opt.step_count + 1)
            # the survivors' commit(): a newcomer never survived a failure (it ends with
            # MPI_Finalize, which a spawned process must call)
            union.Agree(1)
    except (ProcessFailure, MPI.Exception) as lost:
        revoke_all()  # (an error of another class revokes nothing by itself)
        raise JoinAbandoned(f"a process was lost during the join: {lost}") from lost
    return Joined(union, model, meta, time.perf_counter() - t0)
