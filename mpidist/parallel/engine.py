"""What every data-parallel strategy shares: the sharded model base and the optimizer base.

A strategy is two halves, as in the reference system:

* a *model* wrapper (``DDPModel``, ``ZeRO1Model``, ``ZeRO2Model``, ``ZeRO3Model``) that owns
  the flat parameter and gradient storage in a :class:`~mpidist.buffers.ShardedLayout`,
  runs forward/backward unit by unit and synchronises gradients over the data-parallel
  group; and
* an *optimizer* wrapper (``DDPOptimizer``, ...) around a base optimizer from
  :mod:`mpidist.optim` that runs one training step: micro-batches, gradient sync, clipping
  by the global norm, the fused kernel update of the local shard, and the parameter
  allgather where the strategy needs one.

Loss convention (world-size invariance): every rank normalises its local loss by the
*global* number of samples (tokens) of the step, so the sum over ranks of the losses and of
the gradients equals the single-process loss and gradient of the whole global batch.
Gradients are therefore summed, not averaged, over the data-parallel group.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from mpidist import collectives as C
from mpidist.buffers import ShardedLayout
from mpidist.data.sampler import check_local_sizes, split_points
from mpidist.optim.base import Optimizer, OptimizerState
from mpidist.parallel.config import ShardingConfiguration
from mpidist.parallel.loop import run_steps
from mpidist.parallel.training_state import TrainingStateMixin

__all__ = ["OptimizationResult", "ReplicatedParameters", "ShardedModel", "ShardedOptimizer",
           "has_units", "units_of"]


def units_of(module: Any) -> list[Any]:
    units = getattr(module, "units", None)
    if units is None:
        return [module]
    units = list(units)
    if not units:
        raise ValueError(f"{type(module).__name__}.units is empty")
    return units


def has_units(module: Any) -> bool:
    units = getattr(module, "units", None)
    return units is not None and len(list(units)) > 1


class ShardedModel:
    """Base class of the strategy model wrappers. Construction is collective over the mesh.

    Args:
        module: an :class:`mpidist.nn.Module` (its ``units`` are run one at a time where the
            strategy needs it; a module without units is one unit).
        config: the :class:`ShardingConfiguration`; its mesh's "dp" group is used.
        seed: initial parameter values depend only on (seed, parameter name), so every
            rank and every strategy starts from the same model.
    """

    strategy: ClassVar[str] = ""
    #: whether the optimizer state covers only this rank's shard
    shards_state: ClassVar[bool] = True
    #: whether the parameters are stored as this rank's shard only (ZeRO-3)
    shards_params: ClassVar[bool] = False

    def __init__(self, module: Any, config: ShardingConfiguration | None = None, *,
                 seed: int = 0) -> None:
        from mpidist.mesh import ProcessMesh

        self.config = config if config is not None else ShardingConfiguration()
        self.module = module
        self.seed = int(seed)
        self.units = units_of(module)
        self._check_units()
        if self.config.mesh is None:
            self.mesh = ProcessMesh()
            self._owns_mesh = True
        else:
            self.mesh = self.config.mesh
            self._owns_mesh = False
        if self.mesh.shape.pp != 1 or self.mesh.shape.tp != 1:
            raise ValueError(
                f"{type(self).__name__} runs on a data-parallel mesh; got pp={self.mesh.shape.pp}"
                f", tp={self.mesh.shape.tp} (use HybridShardedOptimizer for 3D meshes)"
            )
        self.comm = self.mesh.group("dp")
        self.dp_size = self.comm.Get_size()
        self.dp_rank = self.comm.Get_rank()
        self.dtype = self.config.np_dtype
        self.layout = ShardedLayout(
            [u.named_parameter_shapes() for u in self.units], self.dp_size, self.dp_rank
        )
        self._users = self._tensor_users()
        self.memory: dict[str, int] = {"parameters": 0, "gradients": 0, "working_peak": 0}
        self._working = 0
        self._sync_enabled = True
        self._allocate()
        self._initialize()
        self._bind()

    # -- construction -----------------------------------------------------------------
    def _check_units(self) -> None:
        names = [n for u in self.units for n, _ in u.named_parameter_shapes()]
        if len(set(names)) != len(names):
            raise ValueError("a parameter is registered in two units")
        whole = [n for n, _ in self.module.named_parameter_shapes()]
        if sorted(whole) != sorted(names):
            missing = sorted(set(whole) - set(names))
            raise ValueError(f"parameters outside every unit: {missing}")

    def _tensor_users(self) -> dict[str, list[int]]:
        users: dict[str, list[int]] = {}
        for u, unit in enumerate(self.units):
            for name in unit.parameter_names(include_shared=True):
                users.setdefault(name, []).append(u)
        return users

    def _check_untied(self, what: str) -> None:
        tied = sorted(n for n, us in self._users.items() if len(us) > 1)
        if tied:
            raise ValueError(
                f"{what} shards parameters unit by unit and does not support parameters "
                f"shared between units (tied weights): {tied}"
            )

    def _allocate(self) -> None:
        raise NotImplementedError

    def _initialize(self) -> None:
        """Write the deterministic initial values into this rank's storage."""
        raise NotImplementedError

    def _bind(self) -> None:
        """Bind the module to the storage that stays bound (none for ZeRO-3)."""

    def _init_unit(self, u: int) -> np.ndarray:
        """The unit's full padded initial values (made on every rank, identically)."""
        buf = np.zeros(self.layout.units[u].padded, dtype=self.dtype)
        unit = self.units[u]
        views = self.layout.unit_views(u, buf)
        unit.bind(views, None)
        unit.init_parameters(self.seed)
        unit.unbind()
        return buf

    def _track(self, nbytes: int) -> None:
        self._working += nbytes
        self.memory["working_peak"] = max(self.memory["working_peak"], self._working)

    def _untrack(self, nbytes: int) -> None:
        self._working -= nbytes

    # -- the training step's halves ------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward accumulates gradients locally without synchronising them
        (gradient accumulation); the first synchronised backward after it reduces the sum.
        Strategies that reduce-scatter every backward (ZeRO-2/3) ignore it."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def sync_context(self, last: bool) -> contextlib.AbstractContextManager:
        """The context a training step runs a micro-batch in: synchronise on the last."""
        return contextlib.nullcontext() if last else self.no_sync()

    def zero_grad(self) -> None:
        """Zero this rank's gradient storage. Not collective."""
        raise NotImplementedError

    def forward(self, x: Any, ctx: Any = None) -> Any:
        """Run the model forward. Collective over dp for strategies that gather (ZeRO-3)."""
        raise NotImplementedError

    def backward(self, dy: Any, ctx: Any = None) -> None:
        """Run backward, accumulating gradients (and synchronising them as configured)."""
        raise NotImplementedError

    def finish_gradient_sync(self) -> None:
        """Complete every pending gradient reduction. Collective over dp."""

    def update_pieces(self) -> list[tuple[np.ndarray, np.ndarray, slice]]:
        """``(param, grad, state_slice)`` flat pieces the optimizer updates on this rank."""
        raise NotImplementedError

    @property
    def state_size(self) -> int:
        """Length of the optimizer-state arrays on this rank."""
        return self.layout.local_size if self.shards_state else self.layout.full_size

    def after_update(self) -> None:
        """Make parameters consistent after the shard update (allgather). Collective."""

    def grad_sq_norm(self) -> float:
        """Squared global L2 norm of the synchronised gradients. Collective over dp."""
        raise NotImplementedError

    # -- whole tensors (serialisation, state dicts, checkpoints) ---------------------------
    def full_parameters(self) -> dict[str, np.ndarray]:
        """Every parameter as a full array (a copy for sharded storage). Collective."""
        raise NotImplementedError

    def load_full_parameters(self, params: dict[str, np.ndarray]) -> None:
        """Take this rank's part of full parameter arrays. Not collective."""
        raise NotImplementedError

    def gather_state(self, local: np.ndarray) -> np.ndarray:
        """A state array in the full layout from this rank's state array. Collective."""
        if not self.shards_state:
            return local
        full = np.zeros(self.layout.full_size, dtype=local.dtype)
        reqs = []
        for u in range(len(self.layout.units)):
            seg = self.layout.unit_full(u, full)
            mine = self.layout.unit_shard_of_full(u, full)
            mine[:] = self.layout.unit_local(u, local)
            reqs.append(C.iallgather_inplace(seg, comm=self.comm))
        C.wait_all(reqs)
        return full

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the whole model with its global shape. Pure."""
        return {s.name: s.shape for u in self.layout.units for s in u.specs}

    @property
    def global_layout(self) -> ShardedLayout:
        """The layout of the whole model's tensors (what serialised bytes describe)."""
        return self.layout

    def state_tensors(self, local: np.ndarray) -> dict[str, np.ndarray]:
        """A state array of this rank as whole named tensors (copies). Collective."""
        full = self.gather_state(local)
        return {n: v.copy() for n, v in self.layout.full_views(full).items()}

    def load_state_tensors(self, tensors: dict[str, np.ndarray], local: np.ndarray) -> None:
        """Fill this rank's state array from whole named tensors. Not collective."""
        full = np.zeros(self.layout.full_size, dtype=local.dtype)
        views = self.layout.full_views(full)
        for name, arr in tensors.items():
            views[name][...] = arr
        self.scatter_state(full, local)

    def scatter_state(self, full: np.ndarray, local: np.ndarray) -> None:
        """Copy this rank's part of a full-layout state array into ``local``. Not collective."""
        if not self.shards_state:
            local[:] = full
            return
        for u in range(len(self.layout.units)):
            self.layout.unit_local(u, local)[:] = self.layout.unit_shard_of_full(u, full)

    @property
    def parameter_storage(self) -> np.ndarray:
        """The flat array holding this rank's parameters (full layout, or local shard)."""
        return self.param_shard if self.shards_params else self.params  # type: ignore

    def tensor_pieces(self, array: np.ndarray, *, sharded: bool, owned: bool
                      ) -> list[tuple[str, slice, np.ndarray]]:
        """``(name, flat slice of the tensor, 1-D view of array)`` for named global tensors.

        ``array`` is a local-shard array (``sharded``) or a full-layout one. With ``owned``
        a full-layout array yields only this rank's share (its shard of each unit), so the
        ranks together cover every element once (for writing a checkpoint); without it,
        every element (for reading into replicated storage). Not collective.
        """
        lay = self.layout
        if sharded:
            return [(n, ts, array[ls]) for n, ts, ls in lay.local_pieces()]
        if owned:
            out = []
            for name, ts, ls in lay.local_pieces():
                span = lay.units[lay.unit_of(name)]
                start = span.full_offset + self.dp_rank * span.shard + ls.start - span.local_offset
                out.append((name, ts, array[start:start + (ls.stop - ls.start)]))
            return out
        return [(n, slice(0, s.size), array[s.offset:s.stop])
                for n in lay.names for s in (lay.spec(n),)]

    def memory_report(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients, and the peak working set."""
        return dict(self.memory)

    def free(self) -> None:
        """Free the communicators this wrapper created. Collective over the mesh."""
        if self._owns_mesh:
            self.mesh.free()
            self._owns_mesh = False

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({type(self.module).__name__}, units={len(self.units)}, "
                f"dp={self.dp_size}, dtype={self.dtype})")


class ReplicatedParameters:
    """Mixin for models that keep all their parameters in one full-layout array ``params``
    (DDP, ZeRO-1, ZeRO-2): forward needs no gathering, whole tensors are views, and after a
    sharded update every rank's shards are allgathered."""

    def forward(self: Any, x: Any, ctx: Any = None) -> Any:
        """Forward through every unit. Not collective."""
        h = x
        for unit in self.units:
            h = unit.forward(h, ctx)
        return h

    def full_parameters(self: Any) -> dict[str, np.ndarray]:
        return {n: v.copy() for n, v in self.layout.full_views(self.params).items()}

    def load_full_parameters(self: Any, params: dict[str, np.ndarray]) -> None:
        views = self.layout.full_views(self.params)
        for name, arr in params.items():
            views[name][...] = arr

    def allgather_shards(self: Any) -> None:
        """Allgather every unit's updated shards into ``params``. Collective over dp."""
        if self.dp_size == 1:
            return
        reqs = [C.iallgather_inplace(self.layout.unit_full(u, self.params), comm=self.comm)
                for u in range(len(self.layout.units))]
        C.wait_all(reqs)


@dataclass
class OptimizationResult:
    """What :meth:`ShardedOptimizer.optimize` returns."""

    losses: list[float] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    samples: int = 0
    tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else float("nan")


class ShardedOptimizer(TrainingStateMixin):
    """Base class of the strategy optimizers: one training step over the dp group.

    Args:
        base: the optimizer whose fused kernel updates each shard (``mpidist.optim``).
        config: the :class:`ShardingConfiguration` (a default one when None).
        loss: the loss module (default ``CrossEntropyLoss``), with
            ``forward(outputs, targets, normalizer)`` and ``backward()``.
        lr_schedule: optional callable ``step -> lr`` passed to the kernel each step.
    """

    model_class: ClassVar[type[ShardedModel]] = ShardedModel

    def __init__(self, base: Optimizer, config: ShardingConfiguration | None = None, *,
                 loss: Any = None, lr_schedule: Any = None) -> None:
        if not isinstance(base, Optimizer):
            raise ValueError(
                f"base={base!r} must be an optimizer from mpidist.optim (SGD, Adam, ...)"
            )
        self.base = base
        self.config = config if config is not None else ShardingConfiguration()
        if loss is None:
            from mpidist.nn import CrossEntropyLoss

            loss = CrossEntropyLoss()
        self.loss = loss
        self.lr_schedule = lr_schedule
        self.model: ShardedModel | None = None
        self.state: OptimizerState | None = None
        self._pieces: list[tuple[np.ndarray, np.ndarray, OptimizerState]] = []
        self.step_count = 0
        self.sampler: Any = None
        #: (this rank's loss count, the global batch's) of the last step's batch
        self.batch_share: tuple[int, int] = (0, 0)
        self._data_state: dict[str, Any] | None = None
        self.timers = {"compute": 0.0, "communication": 0.0, "update": 0.0}

    @property
    def strategy(self) -> str:
        return self.model_class.strategy

    # -- model -------------------------------------------------------------------------
    def wrap(self, module: Any, *, seed: int = 0) -> ShardedModel:
        """Wrap ``module`` in this strategy's model and set up the optimizer state.

        Collective over the mesh. Returns the wrapped model to pass to :meth:`step`.
        """
        model = self.model_class(module, self.config, seed=seed)
        self.attach(model)
        return model

    def attach(self, model: ShardedModel) -> None:
        """Use an already wrapped model (and make a fresh optimizer state for it)."""
        if not isinstance(model, self.model_class):
            raise ValueError(
                f"{type(self).__name__} needs a {self.model_class.__name__}, got "
                f"{type(model).__name__}"
            )
        self.model = model
        self.state = self.base.init_state(model.state_size, dtype=model.dtype)
        self._bind_pieces()

    def _bind_pieces(self) -> None:
        self._require_model()
        self._pieces = []
        for p, g, sl in self.model.update_pieces():
            st = OptimizerState(self.state.step,
                                {k: v[sl] for k, v in self.state.buffers.items()})
            self._pieces.append((p, g, st))

    def _resolve(self, model: Any) -> ShardedModel:
        if isinstance(model, ShardedModel):
            if model is not self.model:
                self.attach(model)
            return model
        if self.model is not None and self.model.module is model:
            return self.model
        return self.wrap(model)

    # -- one step ----------------------------------------------------------------------
    def _check_batch(self, model: ShardedModel, x: Any, y: Any) -> tuple[int, int]:
        """Validate the local batch; same answer on every rank (one small allreduce over dp).

        Returns ``(b, total)``: this rank's sample count and the loss normaliser of the
        whole global batch (its samples, or tokens for integer targets), summed over dp.
        Local batches may differ in size (a global batch that does not divide into the
        ranks); each needs at least ``micro_batches`` samples.
        """
        b = len(x)
        m = self.config.micro_batches
        if len(y) != b:
            raise ValueError(f"inputs have {b} samples but targets have {len(y)}")
        n, r = model.dp_size, model.dp_rank
        table = np.zeros(2 * n, dtype=np.int64)
        table[r], table[n + r] = b, self._count(y, self.loss)
        C.allreduce(table, "sum", comm=model.comm)
        check_local_sizes(table[:n], m)
        return b, int(table[n:].sum())

    @staticmethod
    def _count(y: np.ndarray, loss: Any) -> int:
        """Samples the loss normalises by in one call (tokens for integer targets)."""
        y = np.asarray(y)
        if y.dtype.kind in "iu":
            return int(y.size)
        return int(y.shape[0]) if y.ndim else 1

    def _eval_count(self, y: np.ndarray, global_batch_size: int) -> int:
        """The loss normaliser of a whole global batch whose local slice has targets ``y``
        (every sample has as many targets as these); no communication."""
        return self._count(y, self.loss) // max(len(y), 1) * int(global_batch_size)

    def step(self, model: Any, batch: tuple[Any, Any]) -> float:
        """One training step on this rank's local batch ``(x, y)``; returns the global loss.

        Collective over the data-parallel group: every rank passes its own slice of the
        global batch (the slices may differ in size: each rank's loss and gradient are sums
        over its samples divided by the global batch's count, and gradients are summed over
        the ranks, so any split gives the same step). The returned loss is the loss of the
        whole global batch, identical on every rank.
        """
        model = self._resolve(model)
        x, y = batch
        t0 = time.perf_counter()
        local_loss = self._forward_backward(model, x, y)
        t1 = time.perf_counter()
        model.finish_gradient_sync()
        t2 = time.perf_counter()
        self._apply_update(self._clip_scale(model))
        t3 = time.perf_counter()
        model.after_update()
        loss = self._global_loss(model, local_loss)
        t4 = time.perf_counter()
        self.step_count += 1
        self.timers["compute"] += t1 - t0
        self.timers["communication"] += (t2 - t1) + (t4 - t3)
        self.timers["update"] += t3 - t2
        return loss

    # The pieces of a step, which the other strategies reuse or override.
    def _forward_backward(self, model: ShardedModel, x: Any, y: Any, *, sync: bool = True,
                          progress: Callable[[], None] | None = None) -> float:
        """Validate the batch, then forward and backward of every micro-batch, gradients
        synchronised during the last one (never, with ``sync=False``: the communication-
        efficient strategies exchange them themselves); ``progress`` is called after each
        micro-batch. Returns this rank's share of the loss."""
        b, normalizer = self._check_batch(model, x, y)
        m = self.config.micro_batches
        model.zero_grad()
        local_loss = 0.0
        cuts = split_points(b, m)
        for i in range(m):
            xs, ys = x[cuts[i]:cuts[i + 1]], y[cuts[i]:cuts[i + 1]]
            with model.sync_context(last=sync and i == m - 1):
                out = model.forward(xs, ctx=i)
                local_loss += self.loss.forward(out, ys, normalizer=normalizer, ctx=i)
                model.backward(self.loss.backward(ctx=i), ctx=i)
            if progress is not None:
                progress()
        self.batch_share = (self._count(y, self.loss), normalizer)
        return local_loss

    def _lr(self) -> float | None:
        """This step's learning rate from the schedule (None: the optimizer's own)."""
        return self.lr_schedule(self.step_count) if self.lr_schedule is not None else None

    def _clip_scale(self, model: ShardedModel) -> float:
        """The clipping factor ``min(1, max_norm / (norm + 1e-6))`` (torch's), or 1."""
        if self.config.max_grad_norm is None:
            return 1.0
        norm = float(np.sqrt(model.grad_sq_norm()))
        return min(1.0, self.config.max_grad_norm / (norm + 1e-6))

    def _apply_update(self, scale: float) -> None:
        """One fused kernel update of every local piece with ``grad_scale=scale``."""
        lr = self._lr()
        for p, g, st in self._pieces:
            self.base.update(p, g, st, grad_scale=scale, lr=lr)
        self._require_state()
        self.state.step = self._pieces[0][2].step if self._pieces else self.state.step + 1

    def _loss_group(self, model: ShardedModel) -> Any:
        """The group whose ranks' local losses add up to the global loss."""
        return model.comm

    def _global_loss(self, model: ShardedModel, local_loss: float) -> float:
        loss = np.array([local_loss])
        C.allreduce(loss, "sum", comm=self._loss_group(model))
        return float(loss[0])

    def optimize(self, model: Any, data: Any, steps: int, *, global_batch_size: int,
                 seed: int = 0, sampler: Any = None, callback: Any = None
                 ) -> OptimizationResult:
        """Train for ``steps`` steps on ``data`` (anything with ``len`` and ``batch(idx)``).

        Collective over the dp group. Batches come from a
        :class:`~mpidist.data.GlobalBatchSampler` (given, or made from ``global_batch_size``
        and ``seed``), so the trajectory is the same at every data-parallel size.
        ``callback(step, loss)`` runs after each step on every rank.
        """
        from mpidist.data import GlobalBatchSampler

        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
            raise ValueError(f"steps={steps!r} must be a non-negative integer")
        model = self._resolve(model)
        if sampler is None:
            sampler = self.sampler
            if sampler is None or sampler.n_samples != len(data) \
                    or sampler.global_batch_size != global_batch_size:
                sampler = GlobalBatchSampler(len(data), global_batch_size, seed=seed)
        if self._data_state is not None:
            sampler.load_state_dict(self._data_state)
            self._data_state = None
        self.sampler = sampler
        result = OptimizationResult()

        class _Record:
            def after_step(self, model: Any, rec: Any) -> None:
                result.losses.append(rec.loss)
                result.steps += 1
                result.samples += rec.samples
                result.tokens += rec.tokens
                if callback is not None:
                    callback(rec.step, rec.loss)

        t0 = time.perf_counter()
        run_steps(self, model, data, until=self.step_count + int(steps), sampler=sampler,
                  hooks=[_Record()])
        result.seconds = time.perf_counter() - t0
        return result

    def evaluate(self, model: Any, data: Any, *, batches: int, global_batch_size: int,
                 seed: int = 0) -> float:
        """Mean loss over ``batches`` fixed global batches of ``data`` (no update).

        Collective over the dp group; the same batches at every data-parallel size (they
        come from a sampler seeded with ``seed``), so validation losses are comparable
        across runs and world sizes.
        """
        from mpidist.data import GlobalBatchSampler

        model = self._resolve(model)
        sampler = GlobalBatchSampler(len(data), global_batch_size, seed=seed)
        total = np.zeros(1)
        for step in range(batches):
            x, y = data.batch(sampler.local_indices(step, model.dp_rank, model.dp_size))
            normalizer = self._eval_count(y, global_batch_size) * batches
            out = model.forward(x, ctx="eval")
            total[0] += self.loss.forward(out, y, normalizer=normalizer, ctx="eval")
            model.module.clear_cache()
            self.loss.clear_cache()
        C.allreduce(total, "sum", comm=model.comm)
        return float(total[0])

    # -- state ------------------------------------------------------------------------------
    def _require_model(self) -> ShardedModel:
        if self.model is None or self.state is None:
            raise RuntimeError(f"{type(self).__name__} has no model yet; call wrap() first")
        return self.model

    def _require_state(self) -> Any:
        """The optimizer state (made by wrap()); RuntimeError before it exists."""
        self._require_model()
        return self.state

    def synchronize_optimizer_state(self) -> None:
        """Make the optimizer state consistent across ranks. Collective over dp.

        Replicated state (DDP) is broadcast from dp rank 0; sharded state already has one
        owner per element, so only the step count is agreed on.
        """
        model = self._require_model()
        if not model.shards_state:
            for buf in self.state.buffers.values():
                C.broadcast(buf, 0, comm=model.comm)
        step = np.array([self.state.step, self.step_count], dtype=np.int64)
        C.broadcast(step, 0, comm=model.comm)
        self.state.step, self.step_count = int(step[0]), int(step[1])
        for _, _, st in self._pieces:
            st.step = self.state.step

    def memory_report(self) -> dict[str, int]:
        """Per-rank bytes of parameters, gradients, optimizer state and working set."""
        model = self._require_model()
        out = model.memory_report()
        out["optimizer_state"] = int(sum(b.nbytes for b in self.state.buffers.values()))
        out["total"] = out["parameters"] + out["gradients"] + out["optimizer_state"]
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient synchronisation inside (see ``DDPModel.no_sync``)."""
        model = self._require_model()
        with model.no_sync():
            yield
