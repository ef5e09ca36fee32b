"""Elastic data parallelism: workers leave and join a running job at step boundaries.

:class:`ElasticOptimizer` runs a data-parallel strategy (a sharding level 0-3 with any
gradient-communication hook), or a hybrid (pp, dp, tp) mesh whose dp size changes with pp and
tp fixed, on a communicator whose membership may change between steps:

* **Agreement.** :meth:`ElasticOptimizer.maybe_rescale` is called by every worker after each
  step. It is one ``Allreduce(MAX)`` of a small int vector (a leave flag per rank, the
  requested world size), so every worker takes the same decision from the same numbers.
* **Leaving.** A worker that received SIGTERM (the handler only sets a flag) or called
  :meth:`~ElasticOptimizer.request_leave` is split off (``Split`` with ``MPI.UNDEFINED``)
  after handing its shards over; ``maybe_rescale`` then returns None on it and the program
  should end (``exit 0``).
* **Joining.** :meth:`~ElasticOptimizer.scale_to` asks for more workers: the current ones
  ``Spawn`` the difference (the same program: ``sys.executable`` with ``sys.orig_argv``) and
  ``Merge`` with them; in the spawned processes :meth:`~ElasticOptimizer.wrap` notices the
  parent communicator and joins instead of initialising.
* **Redistribution.** Parameters and optimizer state move from the old layout
  ``ShardedLayout(units, dp_old, d)`` to the new ``ShardedLayout(units, dp_new, d')`` in
  memory with one ``Alltoallv`` per flat buffer over the union of old and new workers,
  within each (stage, tp rank) column of the mesh (:mod:`mpidist.parallel.resize`); a
  replicated buffer (DDP state, ZeRO-1/2 parameters) is re-laid-out locally on the workers
  that stay in their column and sent to the others (joiners, workers whose column changed)
  in pieces, one from each old worker of the column. The strategy's model is rebuilt on a
  new :class:`~mpidist.core.mesh.ProcessMesh` (pp, dp, tp) over the new communicator.
* **Hooks.** Before anything moves, :meth:`GradientHook.before_resize
  <mpidist.parallel.hooks.GradientHook.before_resize>` makes the hook's state fit
  (collective over the old workers): async SGD applies its in-flight gradients, Local SGD
  averages its replicas (parameters and optimizer state), and per-rank state that cannot be
  split (compression's error-feedback residuals, PowerSGD's warm starts) restarts from zero,
  the event recording the norm dropped. Then the old model is freed (the communicators the
  hook made for it with it), and the rebuilt model binds the hook anew.

The global batch never changes (each dp index's local batch is its slice of it, ``global /
dp`` samples, one more on the first ``global % dp`` indices), so by the world-size
invariance of every synchronous strategy the trajectory after a change is the uninterrupted
one. With a hook that keeps per-rank state it is the trajectory of a run whose state is
made fit as above at the resize step (async: flushed; Local SGD: averaged; compression:
residuals reset).

A change that would leave fewer than ``min_workers`` or more than ``max_workers``, a number
of workers that is not a multiple of pp*tp, or a dp size the hook cannot run on (Local SGD's
replicas must divide it) is refused (logged, an event, training goes on). Crashes (a worker
killed) end the whole Open MPI job; :mod:`mpidist.run.launch.supervisor` restarts it from the
last checkpoint.

Events (``leave``, ``join``, ``resize``, ``refused``) go to the log and, when ``events`` is
a path, are appended to that JSON-lines file by rank 0 of the new communicator.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpidist.checkpoint.background import wait_in_flight
from mpidist.core.arrays import is_cpu
from mpidist.core.comms import bcast_json, in_place, mpi, phase, traced, world
from mpidist.core.mesh import MeshShape
from mpidist.optim.base import Optimizer
from mpidist.parallel.config import ShardingConfiguration
from mpidist.parallel.engine import ShardedOptimizer
from mpidist.parallel.hooks import GradientHook, check_int
from mpidist.parallel.model import ShardedModel
from mpidist.parallel.placement import LEVEL_NAMES, Placement
from mpidist.parallel.resize import (
    ResizeDecision,
    column_of,
    decide,
    membership,
    transfer_plan,
)

__all__ = [
    "ElasticOptimizer",
    "ResizeDecision",
    "decide",
    "joined_state",
    "maybe_rescale",
    "membership",
    "move_all",
    "transfer_plan",
]

log = logging.getLogger("mpidist.elastic")



# -- the optimizer ------------------------------------------------------------------------
class ElasticOptimizer(ShardedOptimizer):
    """A data-parallel strategy (any level and hook), or a hybrid (pp, dp, tp) one whose dp
    size changes, whose workers may leave and join between steps.

    Args:
        base: the optimizer from :mod:`mpidist.optim` (its fused kernel updates the shards).
        config: a :class:`ShardingConfiguration` without a mesh (the elastic optimizer makes
            one per membership).
        min_workers, max_workers: the allowed world sizes; changes outside are refused.
        strategy: the strategy run at every size: a data-parallel strategy's name
            (one of :data:`~mpidist.parallel.placement.LEVEL_NAMES`);
        zero_stage: or its sharding level, 0-3 (when given, ``strategy`` is not read).
        hook: the gradient communication (:mod:`mpidist.parallel.hooks`, compression...;
            default: the level's synchronous one). Joiners make their own from the same
            program; it must be laid out over the whole dp group (Local SGD: level 0).
        pipeline_parallel_size, tensor_parallel_size: a hybrid mesh: pp and tp stay fixed,
            dp is the number of workers over pp*tp, which must stay a whole number.
        schedule, balance: the pipeline's, as for :class:`ShardedOptimizer`.
        comm: the communicator of the initial workers (default ``MPI.COMM_WORLD``; it is
            duplicated). Ignored in a spawned joiner.
        loss, lr_schedule: as for :class:`ShardedOptimizer`.
        events: a JSON-lines file that rank 0 appends events to, or a callable
            ``events(dict)`` called on rank 0, or None.
        spawn_command, spawn_args: what joiners run (default ``sys.executable`` with
            ``sys.orig_argv[1:]``: the same program with the same arguments).
        handle_sigterm: install a SIGTERM handler that asks this worker to leave (restored
            by :meth:`close`, and when the worker leaves).

    Collective calls are over the current workers (:attr:`comm`); see each method.

    The training loop calls :meth:`maybe_rescale` between steps and runs until the step
    count (not a local counter) reaches the end, so that joiners, which start at the job's
    step, run the same loop::

        opt = ElasticOptimizer(AdamW(lr=1e-3), ShardingConfiguration(), 2, 8,
                               zero_stage=2, events="out/events.jsonl")
        model = opt.wrap(make_model(), seed=0)       # a joiner joins here
        opt.sampler = GlobalBatchSampler(len(data), 24, seed=0)  # every worker, joiners too
        while opt.step_count < steps:
            idx = opt.sampler.next_local(model.dp_rank, model.dp_size)
            opt.step(model, data.batch(idx))
            model = opt.maybe_rescale(model)
            if model is None:                        # this worker left
                break

    :meth:`optimize` is inherited and keeps the membership fixed.
    """

    #: in-job recovery from a lost rank is not built for changing memberships yet
    supports_recovery = False

    def __init__(self, base: Optimizer, config: ShardingConfiguration | None = None,
                 min_workers: int = 1, max_workers: int = 1024, *, strategy: str | None = None,
                 zero_stage: int | None = None, hook: GradientHook | None = None,
                 pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1,
                 schedule: str = "1f1b", balance: str = "uniform", comm: Any = None,
                 loss: Any = None, lr_schedule: Any = None,
                 events: str | Callable[[dict[str, Any]], None] | None = None,
                 spawn_command: str | None = None, spawn_args: Sequence[str] | None = None,
                 handle_sigterm: bool = True) -> None:
        for name, v in (("min_workers", min_workers), ("max_workers", max_workers)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if min_workers > max_workers:
            raise ValueError(f"min_workers={min_workers} is above max_workers={max_workers}")
        if zero_stage is None and strategy is None:
            zero_stage = 0
        if zero_stage is None:
            if strategy not in LEVEL_NAMES:
                raise ValueError(f"strategy={strategy!r} is not one of {list(LEVEL_NAMES)}")
            zero_stage = LEVEL_NAMES.index(strategy)
        config = config if config is not None else ShardingConfiguration()
        if config.mesh is not None:
            raise ValueError("ElasticOptimizer makes its own meshes; give a config with mesh=None")
        if not is_cpu(config.device):
            raise ValueError(f"elastic resizing moves shards with host buffers: it does not run "
                             f"with device={config.device!r}")
        pp = check_int("ElasticOptimizer", "pipeline_parallel_size", pipeline_parallel_size, 1)
        tp = check_int("ElasticOptimizer", "tensor_parallel_size", tensor_parallel_size, 1)
        # The sizes of the first mesh are checked in wrap(): a joiner's own world (the
        # processes spawned together) need not be a multiple of pp*tp.
        super().__init__(base, config, level=zero_stage, hook=hook, loss=loss,
                         lr_schedule=lr_schedule, schedule=schedule, balance=balance,
                         comm=comm)
        self.hook.check(self.level, pp, tp)
        self.shape = MeshShape(pp, 1, tp)
        self.min_workers, self.max_workers = int(min_workers), int(max_workers)
        # A hybrid mesh records "hybrid", as HybridShardedOptimizer does.
        self.inner_strategy = self.hook.strategy_name(
            self.level, "hybrid" if pp * tp > 1 else LEVEL_NAMES[self.level])
        self.events = events
        self.spawn_command = spawn_command or sys.executable
        self.spawn_args = list(spawn_args) if spawn_args is not None else \
            list(getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:])
        self._user_comm = comm
        self._comm: Any = None
        self._mesh: Any = None
        self._leave = False
        self._target = 0
        self.left = False
        #: seconds of the phases of the last change on this worker, and bytes it sent
        self.last_timing: dict[str, float] = {}
        self.history: list[dict[str, Any]] = []
        self._phase_hooks: list[Callable[[str, int], None]] = []
        self._previous_sigterm: Any = None
        self._sigterm_installed = False
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._sigterm_installed = True

    @property
    def strategy(self) -> str:
        """The name checkpoints record: the level's (or "hybrid" on a 3D mesh), with the
        hook's."""
        return self.inner_strategy

    # -- the sampler carries over: a joiner sets its sampler after wrap() ---------------------
    @property
    def sampler(self) -> Any:
        return self._sampler

    @sampler.setter
    def sampler(self, value: Any) -> None:
        self._sampler = value
        pending = getattr(self, "_data_state", None)
        if value is not None and pending is not None:
            value.load_state_dict(pending)
            self._data_state = None

    # -- membership ----------------------------------------------------------------------
    @property
    def comm(self) -> Any:
        """The communicator of the current workers (None before wrap or after leaving)."""
        return self._comm

    @property
    def current_workers(self) -> int:
        """The number of workers now (1 before :meth:`wrap`)."""
        return self._comm.Get_size() if self._comm is not None else 1

    @property
    def can_scale_up(self) -> bool:
        """Whether one more worker would be accepted."""
        return self.current_workers < self.max_workers

    @property
    def can_scale_down(self) -> bool:
        """Whether losing one worker would be accepted."""
        return self.current_workers > self.min_workers

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._leave = True  # only a flag: the step in progress finishes first

    def on_phase(self, hook: Callable[[str, int], None]) -> None:
        """Call ``hook(phase, rank)`` on this worker when a resize reaches ``phase``, with
        its rank before the resize: "redistribute" (the new workers are built, the
        parameters and state about to move). For progress reports, and to test what a
        failure in that phase does. Not collective."""
        self._phase_hooks.append(hook)

    def close(self) -> None:
        """Give SIGTERM back to the handler it had before this optimizer installed its own
        (a worker that leaves does this itself). Not collective; idempotent."""
        if self._sigterm_installed and threading.current_thread() is threading.main_thread():
            previous = self._previous_sigterm
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            self._sigterm_installed = False

    def recover(self, failure: Any) -> Any:
        """The elastic strategy has no in-job recovery (it changes its membership itself):
        a lost rank, in a step or during a resize, ends the job. Raises
        :class:`~mpidist.core.failure.UnrecoverableFailure` at once, without the
        survivors' agreement (a worker that left in the resize no longer answers: an
        agreement over the job's communicator would wait for it forever). The checkpoint
        ``latest`` names is the last one completed (a save is never half-committed); the
        supervisor's restart from it undoes a resize that was under way (the job runs at
        the size it is started with; ``<out>/elastic-target`` asks again). Not collective.
        """
        from mpidist.core.failure import UnrecoverableFailure

        where = f" in step {failure.step}" if failure.step >= 0 else ""
        if failure.phase:
            where += f" ({failure.phase})"
        raise UnrecoverableFailure(
            f"lost a rank{where}; in-job recovery is off (ElasticOptimizer changes its "
            "membership itself): restart from the last checkpoint (the supervisor, "
            "--requeue or mpidist train --resume)") from failure

    def request_leave(self) -> None:
        """Ask for this worker to leave at the next step boundary. Not collective."""
        self._leave = True

    def scale_to(self, n: int) -> None:
        """Ask for ``n`` workers from the next step boundary on. Not collective: one worker
        asking is enough (if several ask, the largest ``n`` wins). Spawns workers to grow;
        to shrink, the highest ranks leave. Refused there if outside [min, max]."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"scale_to(n={n!r}): n must be a positive integer")
        self._target = int(n)

    # -- model ------------------------------------------------------------------------------
    @staticmethod
    def is_joiner() -> bool:
        """Whether this process was spawned to join a running job (and has not yet)."""
        from mpi4py import MPI

        return MPI.Comm.Get_parent() != MPI.COMM_NULL

    def wrap(self, module: Any, *, seed: int = 0) -> ShardedModel:
        """Wrap ``module`` in the strategy's model. Collective over the initial workers.

        In a spawned joiner, instead joins the running job: collective with the current
        workers inside their :meth:`maybe_rescale`, and receives parameters, optimizer
        state, step counts and the data position from them.
        """
        from mpidist.core.mesh import ProcessMesh

        self._module = module
        self._seed = int(seed)
        if self.is_joiner() and self._comm is None:
            return self._join(module)
        comm = world(self._user_comm)
        n = comm.Get_size()
        if not self.min_workers <= n <= self.max_workers:
            raise ValueError(f"{n} workers is outside [min_workers={self.min_workers}, "
                             f"max_workers={self.max_workers}]")
        why = self._size_refusal(n)
        if why is not None:
            raise ValueError(why.removeprefix("refused: "))
        self._comm = comm.Dup()
        self._mesh = ProcessMesh(self._comm, pp=self.shape.pp, tp=self.shape.tp)
        model = self._build_model(module, seed=seed,
                                  config=self.config.replace(mesh=self._mesh))
        self.attach(model)
        self.shape = self._mesh.shape
        return model

    def _size_refusal(self, n: int) -> str | None:
        """Why ``n`` workers cannot run this strategy (None: they can). Pure; the same on
        every worker. A hook whose state is laid out over groups smaller than dp at a
        sharding level (Local SGD's replicas at levels 1-3) cannot be resized at all:
        ValueError."""
        pp, tp = self.shape.pp, self.shape.tp
        if n % (pp * tp):
            return (f"refused: {n} workers is not a multiple of pipeline_parallel_size={pp} x "
                    f"tensor_parallel_size={tp} = {pp * tp}")
        dp = n // (pp * tp)
        try:
            group = self.hook.shard_group(dp)
        except ValueError as e:
            return f"refused: {n} workers ({dp} data-parallel ranks): {e}"
        if self.level > 0 and group != dp:
            raise ValueError(
                f"elastic resizing moves shards laid out over the whole data-parallel group; "
                f"{self.hook.name!r} at level {self.level} shards over groups of {group} of "
                f"the {dp} ranks: use level 0"
            )
        return None

    def _rebuild(self, comm: Any) -> ShardedModel:
        """The model on a new membership, without initial values (the state is about to
        be moved in, so computing them would be wasted work). Collective over ``comm``."""
        from mpidist.core.mesh import ProcessMesh

        mesh = ProcessMesh(comm, pp=self.shape.pp, tp=self.shape.tp)
        self.shape = mesh.shape
        return self._build_model(self._module, seed=self._seed, initialize=False,
                                 config=self.config.replace(mesh=mesh))

    # -- the step boundary --------------------------------------------------------------
    def maybe_rescale(self, model: ShardedModel | None = None) -> ShardedModel | None:
        """Agree on membership changes and carry them out. Collective over :attr:`comm`.

        Call on every worker between steps. Returns the model to train on next (a new
        object after a change), or None on a worker that has left: it should stop training
        and exit. Costs one small allreduce when nothing changes.
        """
        model = self._require_model() if model is None else model
        comm = self._comm
        n = comm.Get_size()
        vec = np.zeros(n + 1, dtype=np.int64)
        vec[comm.Get_rank()] = 1 if self._leave else 0
        vec[n] = self._target
        comm.Allreduce(in_place(), vec, op=mpi().MAX)
        self._target = 0
        d = decide(vec.tolist(), n, self.min_workers, self.max_workers, pp=self.shape.pp,
                   tp=self.shape.tp)
        if d.changes:
            why = self._size_refusal(d.n_new)
            if why is not None:
                d = ResizeDecision(d.n_old, d.leavers, d.joins, refused=why)
        if d.refused is not None:
            self._leave = False
            self._event("refused", d, world_size=n, reason=d.refused)
            return model
        if not d.changes:
            return model
        with phase("resize"):
            return self._rescale(d)

    def _metadata(self) -> dict[str, Any]:
        self._require_model()
        return {
            "strategy": self.inner_strategy,
            "mesh": [self.shape.pp, self.shape.tp],
            "shapes": {n: list(s) for n, s in self.model.tensor_shapes().items()},
            "step": int(self.state.step),
            "steps_taken": int(self.step_count),
            "data": None if self.sampler is None else self.sampler.state_dict(),
            "state_keys": sorted(self.state.buffers),
            "dtype": np.dtype(self.model.dtype).name,
        }

    def _rescale(self, d: ResizeDecision) -> ShardedModel | None:
        """Carry out ``d``. Collective over the old workers, and with the joiners."""
        t0 = time.perf_counter()
        MPI = mpi()
        old_comm, old_mesh = self._comm, self._mesh
        old_model = self._require_model()
        me_old = old_comm.Get_rank()
        # An asynchronous save in flight was written by the old workers: it commits over
        # them (every old worker waits for its writer) before anything moves.
        wait_in_flight(self.step_count)
        # The hook's state made fit for the new workers, then the old model's communicators
        # (the hook's with them) freed: the rebuilt model binds the hook anew.
        hook_fields = self.hook.before_resize(self)
        old_model.free()
        timing: dict[str, float] = {}
        if d.joins:
            inter = old_comm.Spawn(self.spawn_command, self.spawn_args, maxprocs=d.joins,
                                   root=0)
            union = inter.Merge(high=False)
            inter.Disconnect()
            bcast_json({**self._metadata(), "n_old": d.n_old, "leavers": list(d.leavers)},
                        union)
        else:
            union = old_comm
        t1 = time.perf_counter()
        timing["spawn"] = t1 - t0
        _, new_ranks = membership(d)
        me = union.Get_rank()
        staying = new_ranks[me] >= 0
        new_comm = union.Split(0 if staying else MPI.UNDEFINED, new_ranks[me] if staying else 0)
        new_model = self._rebuild(new_comm) if staying else None
        new_state = self.base.init_state(new_model.state_size, dtype=new_model.dtype) \
            if new_model is not None else None
        t2 = time.perf_counter()
        timing["rebuild"] = t2 - t1
        for phase_hook in self._phase_hooks:
            phase_hook("redistribute", me_old)
        moved = move_all(union, d, me, (old_model, self.state), (new_model, new_state))
        t3 = time.perf_counter()
        timing["redistribute"] = t3 - t2
        step = self.state.step
        old_mesh.free()
        old_comm.Free()
        if union is not old_comm:
            union.Free()
        timing["total"] = time.perf_counter() - t0
        timing["bytes_sent"] = float(moved)
        self.last_timing = timing
        if not staying:
            self._comm = self._mesh = None
            self.model, self.state, self.pieces = None, None, []
            self.left = True
            self.close()
            log.warning("[worker %d] left the job after step %d (%d -> %d workers)",
                        me_old, self.step_count, d.n_old, d.n_new)
            return None
        if new_model is None or new_state is None:
            raise RuntimeError("elastic resize: a staying worker built no model")
        new_state.step = step
        self._install(new_comm, new_model, new_state)
        self._event(d.kind, d, world_size=d.n_new, seconds=timing["total"],
                    left=list(d.leavers), joined=d.joins, hook=self.hook.name, **hook_fields)
        return new_model

    def _install(self, comm: Any, model: ShardedModel, state: Any) -> None:
        """Train on ``model`` (bound to this optimizer's hook) from now on."""
        self._comm, self._mesh = comm, model.mesh
        self.model, self.state = model, state
        self.hook = model.hook
        self.hook.opt = self
        self._bind_pieces()

    def _join(self, module: Any) -> ShardedModel:
        """Join a running job (see :meth:`wrap`). Collective with the current workers."""
        MPI = mpi()
        t0 = time.perf_counter()
        parent = traced(MPI.Comm.Get_parent())
        union = parent.Merge(high=True)
        parent.Disconnect()
        meta = bcast_json(None, union)
        if meta["strategy"] != self.inner_strategy:
            raise ValueError(f"joining a {meta['strategy']!r} job with strategy="
                             f"{self.inner_strategy!r}")
        mesh = [self.shape.pp, self.shape.tp]
        if list(meta["mesh"]) != mesh:
            raise ValueError(f"joining a job with (pp, tp)={tuple(meta['mesh'])} as "
                             f"(pp, tp)={tuple(mesh)}")
        me = union.Get_rank()
        size = union.Get_size()
        # The old workers precede the joiners in the union; the leaves, if any, are not
        # known here, so the old workers sent them too (see _metadata / membership).
        n_old = int(meta["n_old"])
        d = ResizeDecision(n_old, tuple(meta["leavers"]), size - n_old)
        _, new_ranks = membership(d)
        new_comm = union.Split(0, new_ranks[me])
        model = self._rebuild(new_comm)
        state = joined_state(self.base, model, meta)
        move_all(union, d, me, None, (model, state))
        union.Free()
        self._install(new_comm, model, state)
        self.restore_position(int(meta["step"]), int(meta["steps_taken"]), meta["data"])
        log.warning("[worker %d] joined the job at step %d (%d workers) in %.3f s",
                    new_comm.Get_rank(), self.step_count, d.n_new, time.perf_counter() - t0)
        return model

    def _event(self, kind: str, d: ResizeDecision, **fields: Any) -> None:
        row = {"event": kind, "step": int(self.step_count), "from": d.n_old, "to": d.n_new,
               **fields, "time": time.time()}
        self.history.append(row)
        comm = self._comm
        if comm is None or comm.Get_rank() != 0:
            return
        if kind == "refused":
            log.warning("elastic: at step %d: %s", self.step_count, fields.get("reason"))
        else:
            log.info("elastic: %s at step %d: %d -> %d workers (%.3f s)", kind,
                     self.step_count, d.n_old, d.n_new, fields.get("seconds", 0.0))
        if callable(self.events):
            self.events(row)
        elif self.events:
            with open(self.events, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    def free(self) -> None:
        """Free the communicators the elastic optimizer made, and the model's (the hook's
        with them). Collective over :attr:`comm`."""
        if self.model is not None:
            self.model.free()
        if self._mesh is not None:
            self._mesh.free()
            self._mesh = None
        if self._comm is not None:
            self._comm.Free()
            self._comm = None


def joined_state(base: Optimizer, model: ShardedModel, meta: dict[str, Any]) -> Any:
    """A joining process's empty optimizer state for ``model``, after checking that its
    tensors and state buffers are the job's (``meta``: the job's ``shapes`` and
    ``state_keys``, as the current workers broadcast them); ValueError naming both when
    they differ (not the same model or optimizer). Not collective."""
    shapes = {n: list(s) for n, s in model.tensor_shapes().items()}
    if shapes != meta["shapes"]:
        raise ValueError(f"the joining model's tensors {shapes} differ from the job's "
                         f"{meta['shapes']}: not the same model")
    state = base.init_state(model.state_size, dtype=model.dtype)
    if sorted(state.buffers) != list(meta["state_keys"]):
        raise ValueError(f"optimizer state {sorted(state.buffers)} differs from the job's "
                         f"{meta['state_keys']}: not the same optimizer")
    return state


def maybe_rescale(opt: ElasticOptimizer, model: ShardedModel | None, step: int | None = None
                  ) -> tuple[ElasticOptimizer, ShardedModel | None, Any]:
    """``(opt, model, comm)`` after the step boundary (see
    :meth:`ElasticOptimizer.maybe_rescale`); ``model`` and ``comm`` are None on a worker that
    has left. ``step`` is accepted for symmetry with training loops and checked against the
    optimizer's count. Collective over ``opt.comm``."""
    if step is not None and step != opt.step_count:
        raise ValueError(f"step={step} differs from the optimizer's step count {opt.step_count}")
    new = opt.maybe_rescale(model)
    return opt, new, opt.comm


# -- MPI helpers ---------------------------------------------------------------------------
Held = tuple[ShardedModel | None, Any] | None  # (model, optimizer state) on one side, or None


def move_all(union: Any, d: ResizeDecision, me: int, old: Held, new: Held,
             ranks: tuple[list[int], list[int]] | None = None) -> int:
    """Move the parameters and every optimizer-state buffer from the old workers' models to
    the new ones (``union``: the old workers first, in their order, then the joiners; ``d``
    the agreed change). ``old`` is None on a joiner, ``new`` (or its model) None on a leaver.
    ``ranks``: each union member's rank in the old and in the new mesh (-1: none), where
    they are not :func:`membership`'s (meshes that order their ranks by node). Also what
    in-job recovery's growing back moves (:mod:`mpidist.parallel.regrow`). Collective over
    ``union``. Returns the bytes this member sent to others."""
    old_model, old_state = old if old is not None else (None, None)
    new_model, new_state = new if new is not None else (None, None)
    model = old_model if old_model is not None else new_model
    if model is None:
        raise RuntimeError("elastic resize: a member with neither an old nor a new model")
    state = old_state if old_state is not None else new_state
    pp, tp = model.pp_size, model.tp_size
    src = None if old_model is None else (old_model.placement, old_model.parameter_storage)
    dst = None if new_model is None else (new_model.placement, new_model.parameter_storage)
    moved = _move(union, d, me, src, dst, sharded=model.shards_params, pp=pp, tp=tp,
                  ranks=ranks)
    for key in sorted(state.buffers):
        src = None if old_model is None else (old_model.placement, old_state.buffers[key])
        dst = None if new_model is None else (new_model.placement, new_state.buffers[key])
        moved += _move(union, d, me, src, dst, sharded=model.shards_state, pp=pp, tp=tp,
                       ranks=ranks)
    return moved


def _move(union: Any, d: ResizeDecision, me: int, src: tuple[Placement, np.ndarray] | None,
          dst: tuple[Placement, np.ndarray] | None, *, sharded: bool, pp: int = 1,
          tp: int = 1, ranks: tuple[list[int], list[int]] | None = None) -> int:
    """Move one flat buffer from the old layout to the new one, within each (stage, tp)
    column of the mesh. Collective over ``union``.

    ``src`` (the old placement and buffer) is None on a joiner, ``dst`` on a leaver. One
    ``Alltoallv``. Returns the bytes this member sent to others.
    """
    old_ranks, new_ranks = ranks if ranks is not None else membership(d)
    numels: dict[int, list[int]] = {}
    old_col = new_col = -1
    if src is not None:
        old_col = column_of(old_ranks[me], d.n_old, pp, tp)[0]
        numels[old_col] = [s.numel for s in src[0].layout.units]
    if dst is not None:
        new_col = column_of(new_ranks[me], d.n_new, pp, tp)[0]
        numels[new_col] = [s.numel for s in dst[0].layout.units]
    sends, recvs = transfer_plan(numels, d.n_old, d.n_new, old_ranks, new_ranks, me,
                                 sharded=sharded, pp=pp, tp=tp)
    dtype = (src if src is not None else dst)[1].dtype  # type: ignore[index]
    if not sharded and src is not None and dst is not None and old_col == new_col:
        # A replicated buffer on a worker that stays in its column: re-lay-out locally
        # (padding moves).
        for u, numel in enumerate(numels[old_col]):
            a = src[0].unit_offset(u, 0, sharded=False)
            b = dst[0].unit_offset(u, 0, sharded=False)
            dst[1][b:b + numel] = src[1][a:a + numel]
    pieces = []
    scounts = np.zeros(len(sends), dtype=np.int64)
    for j, plan in enumerate(sends):
        for u, a, b in plan:
            if src is None:
                raise RuntimeError("elastic resize: sending from a worker with no old shard")
            o = src[0].unit_offset(u, a, sharded=sharded)
            pieces.append(src[1][o:o + b - a])
            scounts[j] += b - a
    sendbuf = np.concatenate(pieces) if pieces else np.empty(0, dtype=dtype)
    rcounts = np.array([sum(b - a for _, a, b in plan) for plan in recvs], dtype=np.int64)
    recvbuf = np.empty(int(rcounts.sum()), dtype=dtype)
    sdispl = np.concatenate([[0], np.cumsum(scounts)[:-1]]).astype(np.int64)
    rdispl = np.concatenate([[0], np.cumsum(rcounts)[:-1]]).astype(np.int64)
    union.Alltoallv([sendbuf, (scounts.tolist(), sdispl.tolist())],
                    [recvbuf, (rcounts.tolist(), rdispl.tolist())])
    pos = 0
    for plan in recvs:
        for u, a, b in plan:
            if dst is None:
                raise RuntimeError("elastic resize: receiving on a worker with no new shard")
            o = dst[0].unit_offset(u, a, sharded=sharded)
            dst[1][o:o + b - a] = recvbuf[pos:pos + b - a]
            pos += b - a
    return int((scounts.sum() - scounts[me]) * np.dtype(dtype).itemsize)
