"""Gradient communication as hooks of the one sharded data-parallel component.

A :class:`~mpidist.parallel.model.ShardedModel` at any sharding level hands its gradients
to a hook, piece by piece as backward produces them: at levels 0-1 the buckets of the full
gradient buffer, at levels 2-3 each unit's gradient buffer, whose sum this rank keeps only
its shard of. The hook decides how the pieces travel:

* :class:`AllReduce` — one (nonblocking, overlapped) allreduce per bucket: DDP, ZeRO-1;
* :class:`ReduceScatter` — one reduce-scatter per unit into the local shard: ZeRO-2/3;
* :class:`~mpidist.parallel.compression.Compression` — a codec with error feedback
  (16-bit floats, top-k, PowerSGD), at every level;
* :class:`LocalSGD` — replicas (groups of ``shard_group`` ranks, which shard their state
  at levels 1-3) step on their own gradient and average every ``period`` steps;
* :class:`AsyncSGD` — the gradient of step t is applied ``staleness`` steps later, while
  its allreduce runs behind the next steps' computation (level 0).

A hook that changes the step itself (Local SGD, async) overrides :meth:`GradientHook.step`.
Exchanges of the communication-efficient hooks go through a
:class:`~mpidist.parallel.exchange.CountingComm`, so their ``bytes_sent`` are measured.
A hook's per-rank state (residuals, replicas, in-flight gradients) is saved in checkpoints
under ``strategy/<state_kind>`` (see :class:`RankState`).

Loss convention (see :mod:`mpidist.parallel.engine`): each rank normalises its local loss
by the global count, so summing gradients over the group gives the global mean gradient.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np

from mpidist.core import collectives as C
from mpidist.core.arrays import as_like, namespace
from mpidist.parallel.exchange import CountingComm, RequestChain, iallreduce

__all__ = ["AllReduce", "AsyncSGD", "GradientHook", "LocalSGD", "RankState", "ReduceScatter",
           "check_int", "default_hook"]


def check_int(owner: str, name: str, value: Any, low: int) -> int:
    """``value`` as an int >= ``low``; ValueError naming it otherwise. Pure."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{owner}: {name}={value!r} must be an integer >= {low}")
    return int(value)


class _Shard:
    """A finished in-place exchange of a unit's buffer, seen as this rank's shard of it."""

    def __init__(self, req: Any, buf: np.ndarray, lo: int, hi: int) -> None:
        self._req, self._buf, self._lo, self._hi = req, buf, lo, hi

    def test(self) -> bool:
        return bool(self._req.test())

    def wait(self) -> np.ndarray:
        self._req.wait()
        return self._buf[self._lo:self._hi]


class RankState:
    """A hook's per-rank state in checkpoints: one row per dp rank of the global tensor
    ``strategy/<state_kind>`` (rows differ between ranks, so it resumes exactly on the
    same number of ranks with the same settings)."""

    state_kind = "none"

    def __init__(self) -> None:
        self._loading: dict[str, Any] | None = None
        self._incoming: np.ndarray | None = None

    def rank_state_arrays(self) -> list[np.ndarray]:
        """This rank's own state (not shared with other ranks), in a fixed order."""
        return []

    def state_attrs(self, model: Any) -> dict[str, Any]:
        """What the checkpoint records about the state (JSON). Not collective."""
        arrays = self.rank_state_arrays()
        if not arrays:
            return {}
        return {"kind": self.state_kind, "dp": model.dp_size,
                "numel": int(sum(a.size for a in arrays))}

    def state_tensors(self, model: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        attrs = self._loading if self._loading is not None else self.state_attrs(model)
        if not attrs:
            return {}
        return {f"strategy/{self.state_kind}": ((attrs["dp"], attrs["numel"]),
                                                np.dtype(model.dtype).name)}

    def state_pieces(self, model: Any, *, for_writing: bool
                     ) -> list[tuple[str, slice, np.ndarray]]:
        if for_writing:
            arrays = self.rank_state_arrays()
            data = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else None
        else:
            data = self._incoming
        if data is None:
            return []
        r, n = model.dp_rank, data.size
        return [(f"strategy/{self.state_kind}", slice(r * n, (r + 1) * n), data)]

    def prepare_state(self, model: Any, attrs: dict[str, Any] | None) -> bool:
        """Check a checkpoint's state ``attrs`` against this run; make the buffers it is
        read into. False when the checkpoint has none of this kind. Not collective."""
        self._loading, self._incoming = None, None
        mine = self.state_attrs(model)
        if not attrs or not mine or attrs.get("kind") != self.state_kind:
            return False
        if attrs["dp"] != mine["dp"] or attrs["numel"] != mine["numel"]:
            raise ValueError(
                f"the checkpoint holds per-rank {self.state_kind} state of {attrs['dp']} "
                f"data-parallel ranks ({attrs['numel']} elements each), which continues "
                f"exactly only on {attrs['dp']} ranks with the same settings; this run has "
                f"{mine['dp']} ranks ({mine['numel']} elements). Resume on {attrs['dp']} "
                "ranks, or with another strategy (e.g. --strategy ddp), which starts the "
                "state afresh"
            )
        self._loading = attrs
        self._incoming = np.empty(attrs["numel"], dtype=model.dtype)
        return True

    def finish_state(self, model: Any) -> None:
        """After loading: move the state read into place. Not collective."""
        data, self._incoming, self._loading = self._incoming, None, None
        if data is None:
            return
        pos = 0
        for a in self.rank_state_arrays():
            a.reshape(-1)[:] = as_like(a, data[pos:pos + a.size])
            pos += a.size


class GradientHook(RankState):
    """How a sharded model's gradient pieces are communicated (see the module doc).

    A hook object serves one model at a time: :meth:`bind` is called by the model once its
    storage exists (and again by a rebuilt model after an elastic resize).
    """

    name = "allreduce"
    #: the sharding levels the hook works at
    levels: tuple[int, ...] = (0, 1, 2, 3)
    #: whether backward exchanges the pieces (False: the hook's ``step`` does)
    exchanges_in_backward = True
    #: whether the exchanges are metered (``bytes_sent``)
    metered = False
    #: whether the hook also runs on a mesh with pipeline or tensor parallelism
    runs_on_3d_mesh = False
    #: whether the hook's exchanges take device arrays (through mpidist's collectives)
    runs_on_device = True

    def __init__(self) -> None:
        super().__init__()
        self.model: Any = None
        self.opt: Any = None  # the optimizer stepping the model (set by its attach)
        self.comm: Any = None
        self.meter: CountingComm | None = None
        self.dense_bytes = 0

    def check(self, level: int, pp: int, tp: int) -> None:
        """ValueError (pure, the same on every rank) when the hook cannot run at ``level``
        on a mesh with these pipeline and tensor sizes."""
        if level not in self.levels:
            raise ValueError(
                f"gradient communication {self.name!r} works at sharding levels "
                f"{list(self.levels)}, not at level {level}{self._why_not(level)}"
            )
        if (pp, tp) != (1, 1) and not self.runs_on_3d_mesh:
            raise ValueError(
                f"gradient communication {self.name!r} runs on a data-parallel mesh; got "
                f"pp={pp}, tp={tp} (3D meshes reduce gradients with allreduce or "
                "reduce-scatter)"
            )

    def _why_not(self, level: int) -> str:
        return ""

    def shard_group(self, dp: int) -> int:
        """How many consecutive dp ranks shard (and reduce gradients over) one replica."""
        return dp

    def bind(self, model: Any, pieces: list[Any]) -> None:
        """Start serving ``model``, whose gradient pieces are ``pieces`` (buckets). Not
        collective (a metered hook with two phases dups its communicator: collective)."""
        self.model = model
        self.comm = model.shard_comm
        if self.metered:
            self.meter = CountingComm(self.comm)
            self.comm = self.meter

    def required(self) -> bool:
        """Whether the pieces need exchanging at all (not on a group of one)."""
        return self.model.shard_size > 1

    def start(self, i: int, g: np.ndarray, *, blocking: bool = False) -> Any:
        """Start summing piece ``i`` (array ``g``) over the group, in place. Returns a
        request (``test``/``wait``). Collective over the shard group."""
        if blocking:
            C.allreduce(g, "sum", comm=self.comm)
            return C.Request([], None)
        return C.iallreduce(g, "sum", comm=self.comm)

    def start_scatter(self, i: int, g: np.ndarray) -> Any:
        """Start reducing unit ``i``'s padded buffer ``g``; the request's ``wait()``
        returns this rank's shard of the sum. Collective over the shard group."""
        n, r = self.model.shard_size, self.model.shard_rank
        s = g.size // n
        return _Shard(self.start(i, g), g, r * s, (r + 1) * s)

    def progress(self) -> None:
        """Let MPI advance exchanges the hook started itself (called between units)."""

    def step(self, opt: Any, model: Any, batch: tuple[Any, Any]) -> float:
        """One training step (the optimizer's synchronous step unless overridden)."""
        return opt.sync_step(model, batch)

    def state_dict(self, opt: Any, state_dict: Any) -> dict[str, Any]:
        """``state_dict()`` as this hook wants it taken (Local SGD: of the replicas'
        average; async: after a flush)."""
        return state_dict()

    def strategy_name(self, level: int, base: str) -> str:
        """The name checkpoints and serialised bytes record for this hook at ``level``."""
        return base

    def extra_memory(self) -> dict[str, int]:
        return {}

    @property
    def bytes_sent(self) -> int:
        return 0 if self.meter is None else int(self.meter.bytes)

    def before_resize(self, opt: Any) -> dict[str, Any]:
        """Make the hook's state fit for an elastic resize, which rebuilds the model on
        other workers and binds this hook to it anew. Called on every old worker before
        the parameters and optimizer state move; returns fields for the resize event.
        Collective over the dp group (of the old workers).

        By default the per-rank state (:meth:`rank_state_arrays`: compression's
        error-feedback residuals and PowerSGD's warm starts) cannot be split over another
        number of ranks: it restarts from zero with the new binding, and the event records
        the global L2 norm of what was dropped (``reset_state_norm``). Hooks without such
        state do nothing.
        """
        arrays = self.rank_state_arrays()
        if not arrays or self.model is None:
            return {}
        sq = np.array([float(sum(np.dot(a.reshape(-1), a.reshape(-1)) for a in arrays))])
        C.allreduce(sq, "sum", comm=self.model.comm)
        return {"reset_state": self.state_kind, "reset_state_norm": float(np.sqrt(sq[0]))}

    def free(self) -> None:
        """Free what :meth:`bind` created. Collective over the shard group."""


class AllReduce(GradientHook):
    """Bucketed allreduce, each bucket started as soon as backward has filled it (DDP)."""

    name = "allreduce"
    runs_on_3d_mesh = True


class ReduceScatter(GradientHook):
    """Each unit's gradients reduce-scattered into the local shard (ZeRO-2, ZeRO-3)."""

    name = "reduce-scatter"
    levels = (2, 3)
    runs_on_3d_mesh = True

    def _why_not(self, level: int) -> str:
        return " (levels 0-1 keep the whole gradient on every rank: use allreduce)"

    def start_scatter(self, i: int, g: np.ndarray) -> Any:
        n = self.model.shard_size
        return C.ireduce_scatter(g, "sum", comm=self.comm,
                                 out=namespace(g).empty(g.size // n, dtype=g.dtype))


def default_hook(level: int) -> GradientHook:
    """The synchronous hook of a level: allreduce at 0-1, reduce-scatter at 2-3."""
    return AllReduce() if level < 2 else ReduceScatter()


class LocalSGD(GradientHook):
    """Local SGD (periodic model averaging; Stich 2019, Lin et al. 2020; DiLoCo's inner
    loop): the dp ranks form replicas of ``shard_group`` consecutive ranks; each replica
    steps on its own batch's mean gradient (synchronously inside the replica, which shards
    its optimizer state, gradients and parameters over its ranks at levels 1-3), and every
    ``period`` steps the replicas are averaged, each weighted by its share of the global
    batch, with one allreduce over the ranks that hold the same shard in every replica
    (parameters, and the optimizer state with ``average_optimizer_state``).

    With ``shard_group=1`` (level 0 only) every rank is its own replica; with
    ``period=1`` and SGD without momentum the averages are DDP's steps. Clipping clips
    each replica's mean gradient by its own norm. ``sync_loss=False`` returns the
    replica's own loss with no per-step communication across replicas.
    """

    name = "localsgd"
    levels = (0, 1, 2, 3)
    metered = True
    state_kind = "local_sgd"

    def __init__(self, period: int = 8, *, shard_group: int = 1,
                 average_optimizer_state: bool = False, sync_loss: bool = True) -> None:
        super().__init__()
        self.period = check_int("LocalSGD", "period", period, 1)
        self.group = check_int("LocalSGD", "shard_group", shard_group, 1)
        for name, v in (("average_optimizer_state", average_optimizer_state),
                        ("sync_loss", sync_loss)):
            if not isinstance(v, bool):
                raise ValueError(f"LocalSGD: {name}={v!r} must be True or False")
        self.average_optimizer_state = average_optimizer_state
        self.sync_loss = sync_loss
        self.averages = 0
        self.replica_comm: Any = None
        self.replica_meter: CountingComm | None = None

    def check(self, level: int, pp: int, tp: int) -> None:
        super().check(level, pp, tp)
        if level >= 1 and self.group == 1:
            raise ValueError(
                f"Local SGD at sharding level {level} shards each replica over shard_group "
                "ranks (--shard-group S); shard_group=1 leaves nothing to shard: give S >= 2 "
                "(replicas of S ranks) or use level 0"
            )

    def shard_group(self, dp: int) -> int:
        if dp % self.group:
            raise ValueError(f"LocalSGD: shard_group={self.group} does not divide the "
                             f"{dp} data-parallel ranks into replicas")
        return self.group

    def bind(self, model: Any, pieces: list[Any]) -> None:
        super().bind(model, pieces)
        r = model.dp_rank
        # Ranks holding the same shard index in every replica; made anew for every model
        # (the previous one, if any, spans the previous model's processes).
        self.free()
        self.replica_comm = model.comm.Split(r % self.group, r // self.group)
        self.replica_meter = CountingComm(self.replica_comm, totals=self.meter)

    def free(self) -> None:
        if self.replica_comm is not None:
            self.replica_comm.Free()
            self.replica_comm = None

    def strategy_name(self, level: int, base: str) -> str:
        return "local_sgd" if level == 0 else f"local_sgd+{base}"

    def _replica_share(self, opt: Any) -> tuple[int, int]:
        """(this replica's loss count, the global batch's) of the last step."""
        counts, total = opt.batch_counts, opt.batch_share[1]
        g = self.model.dp_rank // self.group
        return int(sum(counts[g * self.group:(g + 1) * self.group])), total

    def step(self, opt: Any, model: Any, batch: tuple[Any, Any]) -> float:
        x, y = batch
        t0 = time.perf_counter()
        local_loss = opt.forward_backward(model, x, y)
        model.finish_gradient_sync()
        t1 = time.perf_counter()
        # The gradient is normalised by the global batch; the replica steps on its own
        # batch's mean (replicas' batches may differ in size).
        mine, total = self._replica_share(opt)
        share = total / mine
        scale = share
        if opt.config.max_grad_norm is not None:
            scale *= opt.clip_factor(share * float(np.sqrt(model.grad_sq_norm())))
        opt.apply_update(scale)
        model.after_update()
        opt.step_count += 1
        t2 = time.perf_counter()
        if opt.step_count % self.period == 0:
            self.average_replicas(opt)
        if self.sync_loss:
            loss = opt.global_loss(model, local_loss)
        else:  # the replica's own loss: summed over its group only
            loss = np.array([local_loss])
            if model.shard_size > 1:
                C.allreduce(loss, "sum", comm=model.shard_comm)
            loss = float(loss[0]) * share
        t3 = time.perf_counter()
        opt.timers["compute"] += t1 - t0
        opt.timers["update"] += t2 - t1
        opt.timers["communication"] += t3 - t2
        return loss

    def _replica_arrays(self, opt: Any) -> list[np.ndarray]:
        bufs = [self.model.parameter_storage]
        if self.average_optimizer_state:
            bufs += [b for _, b in sorted(opt.state.buffers.items())]
        return bufs

    def average_replicas(self, opt: Any) -> None:
        """Average the replicas (parameters, and optimizer state if configured), each
        weighted by its share of the last step's global batch. Collective over the dp
        group: one allreduce of one contiguous buffer over the replica communicator."""
        model = self.model
        mine, total = self._replica_share(opt) if opt.batch_share[1] else (0, 0)
        n_replicas = model.dp_size // self.group
        # Weighted by batch share (1/replicas when the batch divides evenly, or before any
        # step), so that with period=1 and plain SGD the average is DDP's step.
        weight = mine / total if total else 1.0 / n_replicas
        bufs = self._replica_arrays(opt)
        if len(bufs) == 1:
            bufs[0] *= model.dtype.type(weight)
            C.allreduce(bufs[0], "sum", comm=self.replica_meter)
        else:
            packed = np.concatenate(bufs)
            packed *= packed.dtype.type(weight)
            C.allreduce(packed, "sum", comm=self.replica_meter)
            pos = 0
            for b in bufs:
                b[:] = packed[pos:pos + b.size]
                pos += b.size
        self.dense_bytes += sum(b.nbytes for b in bufs)
        self.averages += 1

    def before_resize(self, opt: Any) -> dict[str, Any]:
        """Average the replicas, parameters and optimizer state (even without
        ``average_optimizer_state``), weighted by their shares of the last global batch,
        so that every worker, joiners included, continues from the same model and state;
        the period's phase (``step_count % period``) carries on. Collective over dp."""
        keep, self.average_optimizer_state = self.average_optimizer_state, True
        try:
            self.average_replicas(opt)
        finally:
            self.average_optimizer_state = keep
        return {"replicas_averaged": self.model.dp_size // self.group}

    def rank_state_arrays(self) -> list[np.ndarray]:
        """This replica's parameters and optimizer state: between averages they differ
        from replica to replica, so a checkpoint keeps every rank's to resume exactly."""
        opt = self.opt
        if self.model is None or opt is None or opt.state is None:
            return []
        return [self.model.parameter_storage] + [b for _, b in sorted(opt.state.buffers.items())]

    def state_dict(self, opt: Any, state_dict: Any) -> dict[str, Any]:
        """``state_dict()`` of the replica average; the replicas are left as they were and
        the average's bytes are not counted. Collective over dp."""
        saved = [a.copy() for a in self.rank_state_arrays()]
        meter = self.meter
        counted = (meter.bytes, meter.calls, self.dense_bytes, self.averages) if meter else None
        self.average_replicas(opt)
        try:
            return state_dict()
        finally:
            for a, s in zip(self.rank_state_arrays(), saved, strict=True):
                a[:] = s
            if counted is not None and meter is not None:
                meter.bytes, meter.calls, self.dense_bytes, self.averages = counted


class AsyncSGD(GradientHook):
    """SGD with bounded staleness: gradient allreduces overlap the next ``staleness`` steps.

    At step t the local gradient is copied into a buffer whose nonblocking allreduce is
    started at once; then, while more than ``staleness`` exchanges are in flight, the
    oldest is waited for and applied. In steady state step t applies the summed gradient
    of step t - s; the first s steps apply nothing; :meth:`flush` applies every pending
    gradient. ``staleness=0`` is DDP (one allreduce of the whole buffer). Every rank
    applies the same sums in the same order, so replicas stay identical. Clipping uses the
    norm of the applied gradient; the learning-rate schedule is evaluated when applying.
    Level 0 only.
    """

    name = "async"
    runs_on_device = False  # its exchange goes to MPI directly, with host buffers
    levels = (0,)
    exchanges_in_backward = False
    metered = True
    state_kind = "async_sgd"

    def __init__(self, staleness: int = 1) -> None:
        super().__init__()
        self.staleness = check_int("AsyncSGD", "staleness", staleness, 0)
        self.inflight: deque[tuple[RequestChain, np.ndarray]] = deque()
        self._pool: list[np.ndarray] = []
        self._incoming_list: list[np.ndarray] | None = None
        self.buffers_made = 0
        self.applied = 0

    def _why_not(self, level: int) -> str:
        return (" (its in-flight gradients are whole copies applied on every rank; shard "
                "nothing: --zero-stage 0)")

    def strategy_name(self, level: int, base: str) -> str:
        return "async_sgd"

    def bind(self, model: Any, pieces: list[Any]) -> None:
        super().bind(model, pieces)
        self.inflight = deque()
        self.buffers_made = 0

    def progress(self) -> None:
        """Let MPI advance the in-flight allreduces. Not collective."""
        for req, _ in self.inflight:
            req.test()

    def step(self, opt: Any, model: Any, batch: tuple[Any, Any]) -> float:
        x, y = batch
        t0 = time.perf_counter()
        local_loss = opt.forward_backward(model, x, y, progress=self.progress)
        t1 = time.perf_counter()
        buf = self._pool.pop() if self._pool else None
        if buf is None:
            buf = np.empty_like(model.grads)
            self.buffers_made += 1
        buf[:] = model.grads
        self.dense_bytes += buf.nbytes
        self.inflight.append((RequestChain(iallreduce(buf, self.meter), None), buf))
        opt.step_count += 1
        t_update = 0.0
        while len(self.inflight) > self.staleness:
            t_update += self._apply_oldest(opt)
        loss = opt.global_loss(model, local_loss)
        t2 = time.perf_counter()
        opt.timers["compute"] += t1 - t0
        opt.timers["update"] += t_update
        opt.timers["communication"] += t2 - t1 - t_update
        return loss

    def _apply_oldest(self, opt: Any) -> float:
        req, buf = self.inflight.popleft()
        req.wait()
        t0 = time.perf_counter()
        scale = 1.0
        if opt.config.max_grad_norm is not None:
            scale = opt.clip_factor(float(np.sqrt(np.dot(buf, buf))))
        p, _, st = opt.pieces[0]
        opt.base.update(p, buf, st, grad_scale=scale, lr=opt.lr())
        opt.state.step = st.step
        self._pool.append(buf)
        self.applied += 1
        return time.perf_counter() - t0

    def flush(self, opt: Any) -> None:
        """Wait for and apply every in-flight gradient, oldest first. Collective over dp."""
        while self.inflight:
            self._apply_oldest(opt)

    def before_resize(self, opt: Any) -> dict[str, Any]:
        """:meth:`flush` (the in-flight gradients are applied at the resize, as when a
        checkpoint is taken) and drop the spare buffers, whose size is the old model's.
        Collective over dp."""
        flushed = len(self.inflight)
        self.flush(opt)
        self._pool = []
        return {"flushed": flushed}

    def state_dict(self, opt: Any, state_dict: Any) -> dict[str, Any]:
        """:meth:`flush`, then the state dict: it holds every gradient. Collective."""
        self.flush(opt)
        return state_dict()

    # -- the in-flight gradients in checkpoints: named global tensors, the same on every
    # rank, so they resume at any world size --------------------------------------------------
    def state_attrs(self, model: Any) -> dict[str, Any]:
        """Completes the in-flight exchanges (without applying them, so the trajectory is
        unchanged) and records how many there are. Collective over dp."""
        for chain, _ in self.inflight:
            chain.wait()
        return {"kind": self.state_kind, "in_flight": len(self.inflight)}

    def state_tensors(self, model: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        k = self._loading["in_flight"] if self._loading is not None else len(self.inflight)
        dtype = np.dtype(model.dtype).name
        return {f"strategy/async_sgd/{i}/{n}": (shape, dtype) for i in range(k)
                for n, shape in model.tensor_shapes().items()}

    def state_pieces(self, model: Any, *, for_writing: bool
                     ) -> list[tuple[str, slice, np.ndarray]]:
        bufs = [b for _, b in self.inflight] if for_writing else (self._incoming_list or [])
        return [(f"strategy/async_sgd/{i}/{n}", sl, arr) for i, buf in enumerate(bufs)
                for n, sl, arr in model.placement.tensor_pieces(buf, sharded=False,
                                                                owned=for_writing)]

    def prepare_state(self, model: Any, attrs: dict[str, Any] | None) -> bool:
        self._loading, self._incoming_list = None, None
        if not attrs or attrs.get("kind") != self.state_kind:
            return False
        self._loading = attrs
        self._incoming_list = [np.zeros_like(model.grads) for _ in range(attrs["in_flight"])]
        return True

    def finish_state(self, model: Any) -> None:
        bufs, self._incoming_list, self._loading = self._incoming_list, None, None
        if bufs is not None:
            self.inflight = deque((RequestChain([], None), b) for b in bufs)

    def extra_memory(self) -> dict[str, int]:
        model = self.model
        return {"gradient_copies": 0 if model is None else self.buffers_made * model.grads.nbytes}
