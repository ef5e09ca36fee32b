"""Elastic data parallelism: workers leave and join a running job at step boundaries.

:class:`ElasticOptimizer` runs one of the data-parallel strategies (DDP, ZeRO-1/2/3) on a
communicator whose membership may change between steps:

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
  ``ShardedLayout(units, n_old, r)`` to the new ``ShardedLayout(units, n_new, r')`` in
  memory with one ``Alltoallv`` per flat buffer over the union of old and new workers; a
  replicated buffer (DDP state, ZeRO-1/2 parameters) is re-laid-out locally on the workers
  that stay and sent to the joiners in pieces, one from each old worker. The strategy's
  model is rebuilt on a new :class:`~mpidist.mesh.ProcessMesh` over the new communicator.

The global batch never changes (each worker's local batch is its slice of it, ``global / n``
samples, one more on the first ``global % n`` workers), so by the world-size
invariance of every strategy the trajectory after a change is the uninterrupted one.

A change that would leave fewer than ``min_workers`` or more than ``max_workers`` is refused
(logged, an event, training goes on). Crashes (a worker killed) end the whole Open MPI job;
:mod:`mpidist.launch.supervisor` restarts it from the last checkpoint.

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
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpidist.buffers import padded_length
from mpidist.comms import bcast_json, in_place, mpi, world
from mpidist.optim.base import Optimizer
from mpidist.parallel.config import ShardingConfiguration
from mpidist.parallel.engine import ShardedOptimizer
from mpidist.parallel.model import ShardedModel
from mpidist.parallel.placement import LEVEL_NAMES, Placement

__all__ = [
    "ElasticOptimizer",
    "ResizeDecision",
    "decide",
    "maybe_rescale",
    "transfer_plan",
]

log = logging.getLogger("mpidist.elastic")



# -- pure arithmetic: the decision and the transfer plan -----------------------------------
@dataclass(frozen=True)
class ResizeDecision:
    """What the workers agreed on at a step boundary (identical on every worker)."""

    n_old: int
    leavers: tuple[int, ...]
    joins: int
    refused: str | None = None

    @property
    def n_new(self) -> int:
        return self.n_old - len(self.leavers) + self.joins

    @property
    def changes(self) -> bool:
        return self.refused is None and (bool(self.leavers) or self.joins > 0)

    @property
    def kind(self) -> str:
        if self.leavers and self.joins:
            return "resize"
        return "leave" if self.leavers else "join"


def decide(vector: Sequence[int], n_old: int, min_workers: int, max_workers: int
           ) -> ResizeDecision:
    """The membership change encoded in the reduced request vector. Pure.

    ``vector[:n_old]`` are leave flags by rank; ``vector[n_old]`` is the largest requested
    world size (0: none). A requested size below the size after the leaves turns into
    leaves of the highest ranks; above, into joins. A result outside
    ``[min_workers, max_workers]`` is refused as a whole, with the reason.
    """
    flags = [r for r in range(n_old) if vector[r]]
    target = int(vector[n_old])
    after_leaves = n_old - len(flags)
    joins = 0
    leavers = list(flags)
    if target > 0:
        if target > after_leaves:
            joins = target - after_leaves
        elif target < after_leaves:
            stay = [r for r in range(n_old) if r not in flags]
            leavers = sorted(flags + stay[target:])
    d = ResizeDecision(n_old, tuple(leavers), joins)
    if not d.changes:
        return d
    n_new = d.n_new
    if n_new < min_workers:
        why = (f"refused: the change {n_old} -> {n_new} workers (leaving ranks "
               f"{list(leavers)}) would go below min_workers={min_workers}")
        return ResizeDecision(n_old, tuple(leavers), joins, refused=why)
    if n_new > max_workers:
        why = (f"refused: the change {n_old} -> {n_new} workers would go above "
               f"max_workers={max_workers}")
        return ResizeDecision(n_old, tuple(leavers), joins, refused=why)
    return d


def membership(d: ResizeDecision) -> tuple[list[int], list[int]]:
    """``(old_ranks, new_ranks)`` of every member of the union communicator (old workers
    first, then joiners), -1 where a member has no rank. Pure."""
    left = set(d.leavers)
    old = list(range(d.n_old)) + [-1] * d.joins
    new, nxt = [], 0
    for i in range(d.n_old + d.joins):
        if i < d.n_old and i in left:
            new.append(-1)
        else:
            new.append(nxt)
            nxt += 1
    return old, new


def _owned(numel: int, n: int, r: int) -> tuple[int, int]:
    s = padded_length(numel, n) // n
    return min(r * s, numel), min((r + 1) * s, numel)


Plan = list[list[tuple[int, int, int]]]  # per peer: (unit, start, stop) in unit elements


def transfer_plan(numels: Sequence[int], n_old: int, n_new: int, old_ranks: Sequence[int],
                  new_ranks: Sequence[int], me: int, *, sharded: bool) -> tuple[Plan, Plan]:
    """What member ``me`` of the union sends to and receives from every member. Pure.

    Ranges are in each unit's unpadded element index. A sharded buffer: the old owner of
    an element sends it to its new owner. A replicated buffer: members that stay keep
    theirs (re-laid-out locally); each joiner gets every element from its old owner, so
    the old workers share the sending evenly.
    """
    size = len(old_ranks)

    def have(i: int, numel: int) -> tuple[int, int] | None:
        return None if old_ranks[i] < 0 else _owned(numel, n_old, old_ranks[i])

    def need(j: int, numel: int) -> tuple[int, int] | None:
        if new_ranks[j] < 0:
            return None
        if sharded:
            return _owned(numel, n_new, new_ranks[j])
        return (0, numel) if old_ranks[j] < 0 else None

    def inter(i: int, j: int) -> list[tuple[int, int, int]]:
        out = []
        for u, numel in enumerate(numels):
            h, w = have(i, numel), need(j, numel)
            if h is None or w is None:
                continue
            a, b = max(h[0], w[0]), min(h[1], w[1])
            if a < b:
                out.append((u, a, b))
        return out

    sends = [inter(me, j) for j in range(size)]
    recvs = [inter(i, me) for i in range(size)]
    return sends, recvs


# -- the optimizer ------------------------------------------------------------------------
class ElasticOptimizer(ShardedOptimizer):
    """A data-parallel strategy whose workers may leave and join between steps.

    Args:
        base: the optimizer from :mod:`mpidist.optim` (its fused kernel updates the shards).
        config: a :class:`ShardingConfiguration` without a mesh (the elastic optimizer makes
            one per membership).
        min_workers, max_workers: the allowed world sizes; changes outside are refused.
        strategy: the strategy run at every size: a data-parallel strategy's name
            (one of :data:`~mpidist.parallel.placement.LEVEL_NAMES`);
        zero_stage: or its sharding level, 0-3 (when given, ``strategy`` is not read).
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
                               strategy="zero2", events="out/events.jsonl")
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

    def __init__(self, base: Optimizer, config: ShardingConfiguration | None = None,
                 min_workers: int = 1, max_workers: int = 1024, *, strategy: str = "ddp",
                 zero_stage: int | None = None, comm: Any = None, loss: Any = None,
                 lr_schedule: Any = None,
                 events: str | Callable[[dict[str, Any]], None] | None = None,
                 spawn_command: str | None = None, spawn_args: Sequence[str] | None = None,
                 handle_sigterm: bool = True) -> None:
        for name, v in (("min_workers", min_workers), ("max_workers", max_workers)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if min_workers > max_workers:
            raise ValueError(f"min_workers={min_workers} is above max_workers={max_workers}")
        if zero_stage is None:
            if strategy not in LEVEL_NAMES:
                raise ValueError(f"strategy={strategy!r} is not one of {list(LEVEL_NAMES)}")
            zero_stage = LEVEL_NAMES.index(strategy)
        config = config if config is not None else ShardingConfiguration()
        if config.mesh is not None:
            raise ValueError("ElasticOptimizer makes its own meshes; give a config with mesh=None")
        super().__init__(base, config, level=zero_stage, loss=loss, lr_schedule=lr_schedule,
                         comm=comm)
        self.min_workers, self.max_workers = int(min_workers), int(max_workers)
        self.inner_strategy = super().strategy
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
        from mpidist.mesh import ProcessMesh

        self._module = module
        self._seed = int(seed)
        if self.is_joiner() and self._comm is None:
            return self._join(module)
        comm = world(self._user_comm)
        n = comm.Get_size()
        if not self.min_workers <= n <= self.max_workers:
            raise ValueError(f"{n} workers is outside [min_workers={self.min_workers}, "
                             f"max_workers={self.max_workers}]")
        self._comm = comm.Dup()
        self._mesh = ProcessMesh(self._comm)
        model = self._build_model(module, seed=seed,
                                  config=self.config.replace(mesh=self._mesh))
        self.attach(model)
        return model

    def _rebuild(self, comm: Any) -> ShardedModel:
        """The model on a new membership, without initial values (the state is about to
        be moved in, so computing them would be wasted work). Collective over ``comm``."""
        from mpidist.mesh import ProcessMesh

        return self._build_model(self._module, seed=self._seed, initialize=False,
                                 config=self.config.replace(mesh=ProcessMesh(comm)))

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
        d = decide(vec.tolist(), n, self.min_workers, self.max_workers)
        if d.refused is not None:
            self._leave = False
            self._event("refused", d, world_size=n, reason=d.refused)
            return model
        if not d.changes:
            return model
        return self._rescale(d)

    def _metadata(self) -> dict[str, Any]:
        self._require_model()
        return {
            "strategy": self.inner_strategy,
            "numels": [s.numel for s in self.model.layout.units],
            "step": int(self.state.step),
            "steps_taken": int(self.step_count),
            "data": None if self.sampler is None else self.sampler.state_dict(),
            "state_keys": sorted(self.state.buffers),
            "dtype": np.dtype(self.model.dtype).name,
        }

    def _rescale(self, d: ResizeDecision) -> ShardedModel | None:
        t0 = time.perf_counter()
        MPI = mpi()
        old_comm, old_mesh, old_model = self._comm, self._mesh, self.model
        old_model = self._require_model()
        me_old = old_comm.Get_rank()
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
        old_ranks, new_ranks = membership(d)
        me = union.Get_rank()
        staying = new_ranks[me] >= 0
        new_comm = union.Split(0 if staying else MPI.UNDEFINED, new_ranks[me] if staying else 0)
        new_model = self._rebuild(new_comm) if staying else None
        new_state = self.base.init_state(new_model.state_size, dtype=new_model.dtype) \
            if new_model is not None else None
        numels = [s.numel for s in old_model.layout.units]
        t2 = time.perf_counter()
        timing["rebuild"] = t2 - t1
        for hook in self._phase_hooks:
            hook("redistribute", me_old)
        moved = _move(union, numels, d, old_ranks, new_ranks, me,
                      old_model.placement, old_model.parameter_storage,
                      new_model.placement if new_model else None,
                      new_model.parameter_storage if new_model else None,
                      sharded=old_model.shards_params)
        for key in sorted(self.state.buffers):
            moved += _move(union, numels, d, old_ranks, new_ranks, me,
                           old_model.placement, self.state.buffers[key],
                           new_model.placement if new_model else None,
                           new_state.buffers[key] if new_state else None,
                           sharded=old_model.shards_state)
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
        self._comm, self._mesh = new_comm, new_model.mesh
        self.model, self.state = new_model, new_state
        self._bind_pieces()
        self._event(d.kind, d, world_size=d.n_new, seconds=timing["total"],
                    left=list(d.leavers), joined=d.joins)
        return new_model

    def _join(self, module: Any) -> ShardedModel:
        MPI = mpi()
        t0 = time.perf_counter()
        parent = MPI.Comm.Get_parent()
        union = parent.Merge(high=True)
        parent.Disconnect()
        meta = bcast_json(None, union)
        if meta["strategy"] != self.inner_strategy:
            raise ValueError(f"joining a {meta['strategy']!r} job with strategy="
                             f"{self.inner_strategy!r}")
        me = union.Get_rank()
        size = union.Get_size()
        # The old workers precede the joiners in the union; the leaves, if any, are not
        # known here, so the old workers sent them too (see _metadata / membership).
        n_old = int(meta["n_old"])
        d = ResizeDecision(n_old, tuple(meta["leavers"]), size - n_old)
        old_ranks, new_ranks = membership(d)
        new_comm = union.Split(0, new_ranks[me])
        model = self._rebuild(new_comm)
        numels = [s.numel for s in model.layout.units]
        if numels != list(meta["numels"]):
            raise ValueError(f"the joining model's units have {numels} elements, the job's "
                             f"{meta['numels']}: not the same model")
        state = self.base.init_state(model.state_size, dtype=model.dtype)
        if sorted(state.buffers) != list(meta["state_keys"]):
            raise ValueError(f"optimizer state {sorted(state.buffers)} differs from the job's "
                             f"{meta['state_keys']}: not the same optimizer")
        _move(union, numels, d, old_ranks, new_ranks, me, None, None, model.placement,
              model.parameter_storage, sharded=model.shards_params)
        for key in sorted(state.buffers):
            _move(union, numels, d, old_ranks, new_ranks, me, None, None, model.placement,
                  state.buffers[key], sharded=model.shards_state)
        union.Free()
        self._comm, self._mesh = new_comm, model.mesh
        self.model, self.state = model, state
        self._bind_pieces()
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
        """Free the communicators the elastic optimizer made. Collective over :attr:`comm`."""
        if self._mesh is not None:
            self._mesh.free()
            self._mesh = None
        if self._comm is not None:
            self._comm.Free()
            self._comm = None


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
def _move(union: Any, numels: list[int], d: ResizeDecision, old_ranks: list[int],
          new_ranks: list[int], me: int, src_place: Placement | None,
          src: np.ndarray | None, dst_place: Placement | None, dst: np.ndarray | None,
          *, sharded: bool) -> int:
    """Move one flat buffer from the old layout to the new one. Collective over ``union``.

    ``src`` is None on a joiner, ``dst`` None on a leaver. One ``Alltoallv``. Returns the
    bytes this member sent to others.
    """
    n_new = d.n_new
    sends, recvs = transfer_plan(numels, d.n_old, n_new, old_ranks, new_ranks, me,
                                 sharded=sharded)
    dtype = (src if src is not None else dst).dtype  # type: ignore[union-attr]
    if not sharded and src is not None and dst is not None:
        # A replicated buffer on a worker that stays: re-lay-out locally (padding moves).
        if src_place is None or dst_place is None:
            raise RuntimeError("elastic resize: a staying worker lacks a placement")
        for u, numel in enumerate(numels):
            a = src_place.unit_offset(u, 0, sharded=False)
            b = dst_place.unit_offset(u, 0, sharded=False)
            dst[b:b + numel] = src[a:a + numel]
    pieces = []
    scounts = np.zeros(len(sends), dtype=np.int64)
    for j, plan in enumerate(sends):
        for u, a, b in plan:
            if src_place is None or src is None:
                raise RuntimeError("elastic resize: sending from a worker with no old shard")
            o = src_place.unit_offset(u, a, sharded=sharded)
            pieces.append(src[o:o + b - a])
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
            if dst_place is None or dst is None:
                raise RuntimeError("elastic resize: receiving on a worker with no new shard")
            o = dst_place.unit_offset(u, a, sharded=sharded)
            dst[o:o + b - a] = recvbuf[pos:pos + b - a]
            pos += b - a
    return int((scounts.sum() - scounts[me]) * np.dtype(dtype).itemsize)
