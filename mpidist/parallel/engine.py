"""The training step of every strategy: :class:`ShardedOptimizer`.

A strategy is two halves, as in the reference system: the model, wrapped in the one
sharded data-parallel component (:class:`~mpidist.parallel.model.ShardedModel`: a level,
a gradient-communication hook, a mesh), and this optimizer around a base optimizer from
:mod:`mpidist.optim`, which runs one training step: micro-batches (through the pipeline
schedule when pp > 1), gradient sync, clipping by the global norm, the fused kernel update
of the local shard, and the parameter allgather where the level needs one. A hook that
changes the step (Local SGD, async) runs its own, built from the same public pieces.

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

from mpidist.checkpoint.background import in_flight
from mpidist.core import collectives as C
from mpidist.core import recorder
from mpidist.core.comms import phase, set_step, world
from mpidist.core.failure import ProcessFailure, failure_behind
from mpidist.core.timeline import span
from mpidist.data.sampler import check_local_sizes, split_points
from mpidist.optim.base import Optimizer, OptimizerState
from mpidist.optim.clipping import clip_coefficient
from mpidist.parallel.config import ShardingConfiguration
from mpidist.parallel.hooks import GradientHook, default_hook
from mpidist.parallel.loop import run_steps
from mpidist.parallel.model import ShardedModel, resolve_mesh_shape
from mpidist.parallel.pipeline import BALANCES, PipelineStage, check_schedule
from mpidist.parallel.placement import LEVEL_NAMES, LEVELS
from mpidist.parallel.precision import LossScaler, ScaledLoss
from mpidist.parallel.recovery import RecoveryMixin
from mpidist.parallel.redundancy import MODES
from mpidist.parallel.tensor import check_loss, tensor_parallel_styles, vocab_sharded
from mpidist.parallel.training_state import TrainingStateMixin

__all__ = ["OptimizationResult", "ShardedOptimizer"]


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


class ShardedOptimizer(TrainingStateMixin, RecoveryMixin):
    """One training step of a model sharded at ``level`` over the data-parallel group, its
    gradients communicated by ``hook``, on a (pp, dp, tp) mesh.

    Args:
        base: the optimizer whose fused kernel updates each shard (``mpidist.optim``).
        config: the :class:`ShardingConfiguration` (a default one when None).
        level: 0-3, what is sharded over dp (nothing, optimizer state, + gradients,
            + parameters).
        hook: the gradient communication (:mod:`mpidist.parallel.hooks`; default:
            allreduce at levels 0-1, reduce-scatter at 2-3).
        loss: the loss module (default ``CrossEntropyLoss``), with
            ``forward(outputs, targets, normalizer)`` and ``backward()``.
        lr_schedule: optional callable ``step -> lr`` passed to the kernel each step.
        pipeline_parallel_size, tensor_parallel_size, data_parallel_size: mesh sizes when
            ``config.mesh`` is None (on ``comm``; default ``MPI.COMM_WORLD``).
        schedule: the pipeline schedule when pp > 1: "1f1b", "gpipe", "interleaved"
            (Megatron's interleaved 1F1B over ``virtual_stages`` chunks per stage: the
            bubble divided by them; ``micro_batches`` a multiple of pp) or "zero-bubble"
            (ZB-H1: each backward split into the input gradient, sent upstream at once,
            and the weight gradients, deferred into the bubble).
        virtual_stages: model chunks per stage (the interleaved schedule; the model needs
            at least pp x virtual_stages units); None: ``config.virtual_stages``.
        balance: the pipeline stage split, "uniform" or "parameters".
        tp_plan: the tensor-parallel plan when tp > 1 (see :mod:`mpidist.nn.tp_plan`;
            default: the model's own).
        redundancy: the copies that let the survivors of a lost rank go on in the job
            (:mod:`mpidist.parallel.recovery`): "buddy" (ddp and ZeRO-1/2/3, with pipeline
            and tensor parallelism too), "none", or None: "buddy" where MPI's fault
            tolerance (ULFM) is on and the strategy can keep them, else "none". With
            copies, :meth:`step` raises :class:`~mpidist.parallel.recovery.MeshChanged`
            after recovering from a lost rank.

    Construction is pure: bad values raise ValueError on every rank alike.
    """

    #: the name checkpoints record for the storage (``None``: from the level)
    base_name: ClassVar[str | None] = None
    #: the level when none is given (the entry points DDPOptimizer... fix theirs)
    default_level: ClassVar[int] = 0
    #: whether a lost rank can be recovered from in the job (see ``redundancy``)
    supports_recovery: ClassVar[bool] = True

    def __init__(self, base: Optimizer, config: ShardingConfiguration | None = None, *,
                 level: int | None = None, hook: GradientHook | None = None, loss: Any = None,
                 lr_schedule: Any = None, pipeline_parallel_size: int = 1,
                 tensor_parallel_size: int = 1, data_parallel_size: int = -1,
                 schedule: str = "1f1b", balance: str = "uniform", comm: Any = None,
                 tp_plan: Any = None, virtual_stages: int | None = None,
                 redundancy: str | None = None) -> None:
        if not isinstance(base, Optimizer):
            raise ValueError(
                f"base={base!r} must be an optimizer from mpidist.optim (SGD, Adam, ...)"
            )
        level = self.default_level if level is None else level
        if isinstance(level, bool) or level not in LEVELS:
            raise ValueError(f"zero_stage={level!r} must be 0, 1, 2 or 3")
        if balance not in BALANCES:
            raise ValueError(f"balance={balance!r} is not one of {BALANCES}")
        if redundancy is not None and redundancy not in MODES:
            raise ValueError(f"redundancy={redundancy!r} is not one of {MODES}")
        self.base = base
        self.redundancy_mode = redundancy
        #: the copies for in-job recovery (None: a lost rank ends the training)
        self.redundancy: Any = None
        #: (step count, sampler position) when the last step began
        self.step_entry: tuple[int, int | None] = (0, None)
        self.config = config if config is not None else ShardingConfiguration()
        if virtual_stages is not None:
            self.config = self.config.replace(virtual_stages=virtual_stages)
        self.level = int(level)
        self.hook = hook if hook is not None else default_hook(self.level)
        self.schedule = check_schedule(schedule)
        self.balance = balance
        self.tp_plan = tp_plan
        #: the communicator a mesh is built on when ``config.mesh`` is None (resolved here,
        #: at the entry point: nothing below reads MPI.COMM_WORLD)
        self.build_comm = world(comm) if self.config.mesh is None else comm
        self.shape = resolve_mesh_shape(self.config, comm, pipeline_parallel_size,
                                        tensor_parallel_size, data_parallel_size)
        self.hook.check(self.level, self.shape.pp, self.shape.tp)
        self._check_schedule()
        if loss is None:
            from mpidist.nn import CrossEntropyLoss

            loss = CrossEntropyLoss()
        self.loss = loss
        #: fp16's dynamic loss scale (None in full precision and with bfloat16)
        self.scaler = LossScaler() if self.config.precision == "mixed-fp16" else None
        if self.scaler is not None and type(self.hook).step is not GradientHook.step:
            raise ValueError(f"precision='mixed-fp16' scales the loss in the synchronous "
                             f"step; the {self.hook.name} hook runs its own step: use "
                             "mixed-bf16 (no loss scale) or full precision")
        self.lr_schedule = lr_schedule
        self.model: ShardedModel | None = None
        self.state: OptimizerState | None = None
        #: ``(param, grad, state)`` flat pieces the fused kernel updates on this rank
        self.pieces: list[tuple[np.ndarray, np.ndarray, OptimizerState]] = []
        self.step_count = 0
        self.sampler: Any = None
        #: (this rank's loss count, the global batch's) of the last step's batch
        self.batch_share: tuple[int, int] = (0, 0)
        #: every dp index's loss count of the last step's batch
        self.batch_counts: list[int] = []
        self.bytes_sent_last_step = 0
        self._data_state: dict[str, Any] | None = None
        self.timers = {"compute": 0.0, "communication": 0.0, "update": 0.0}

    def _check_schedule(self) -> None:
        """The schedule against the virtual stages and micro-batches (pure)."""
        v, m, pp = self.config.virtual_stages, self.config.micro_batches, self.shape.pp
        if v > 1 and self.schedule != "interleaved":
            raise ValueError(f"virtual_stages={v} needs schedule='interleaved' "
                             f"(got schedule={self.schedule!r})")
        if self.schedule == "interleaved" and m % pp:
            raise ValueError(f"schedule='interleaved' needs micro_batches a multiple of "
                             f"pp={pp}; got micro_batches={m}")

    @property
    def strategy(self) -> str:
        """The strategy's name as checkpoints and serialised bytes record it."""
        base = self.base_name or LEVEL_NAMES[self.level]
        return self.hook.strategy_name(self.level, base)

    # -- model -------------------------------------------------------------------------
    def wrap(self, module: Any, *, seed: int = 0) -> ShardedModel:
        """Wrap ``module`` in the sharded model and set up the optimizer state.

        Collective over the mesh. Returns the wrapped model to pass to :meth:`step`.
        """
        self.attach(self._build_model(module, seed=seed))
        return self.model  # type: ignore[return-value]

    def _build_model(self, module: Any, *, seed: int, config: ShardingConfiguration | None = None,
               initialize: bool = True) -> ShardedModel:
        if self.shape.tp > 1 and vocab_sharded(
                module, tensor_parallel_styles(module, self.tp_plan, self.shape.tp)):
            check_loss(self.loss, self.shape.tp)
        config = config if config is not None else self.config
        sizes = {} if config.mesh is not None else {
            "pipeline_parallel_size": self.shape.pp, "tensor_parallel_size": self.shape.tp,
            "data_parallel_size": self.shape.dp}
        return ShardedModel(module, config, seed=seed, level=self.level, hook=self.hook,
                            balance=self.balance, comm=self.build_comm, tp_plan=self.tp_plan,
                            initialize=initialize,
                            **sizes)

    def attach(self, model: ShardedModel) -> None:
        """Use an already wrapped model (and make a fresh optimizer state for it)."""
        if not isinstance(model, ShardedModel) or model.level != self.level \
                or type(model.hook) is not type(self.hook) \
                or len(model.chunks) != self.config.virtual_stages:
            raise ValueError(
                f"{type(self).__name__} needs a model sharded at level {self.level} with "
                f"{self.hook.name} gradient communication and "
                f"{self.config.virtual_stages} chunk(s) per stage, got {model!r}"
            )
        self.model = model
        self.hook = model.hook
        self.hook.opt = self
        self.state = self.base.init_state(model.state_size, dtype=model.dtype,
                                          device=model.device)
        self._bind_pieces()
        self.setup_redundancy()

    def _bind_pieces(self) -> None:
        self._require_model()
        self.pieces = []
        for p, g, sl in self.model.update_pieces():
            st = OptimizerState(self.state.step,
                                {k: v[sl] for k, v in self.state.buffers.items()})
            self.pieces.append((p, g, st))

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
        """Local checks first (no communication), then one small allreduce over the mesh:
        every pp and tp rank of a dp index has the same local batch, and each has at least
        ``micro_batches`` samples (local batches of different dp indices may differ: a
        global batch that does not divide into the ranks). Returns ``(b, total)``: this
        rank's sample count and the loss normaliser (samples, or tokens for integer
        targets) of the whole global batch."""
        b = len(x)
        if len(y) != b:
            raise ValueError(f"inputs have {b} samples but targets have {len(y)}")
        n, r = model.dp_size, model.dp_rank
        # Per dp index: the largest and (negated) smallest size and count seen on its ranks.
        table = np.full(4 * n, np.iinfo(np.int64).min, dtype=np.int64)
        count = self._count(y, self.loss)
        table[[r, n + r, 2 * n + r, 3 * n + r]] = b, -b, count, -count
        C.allreduce(table, "max", comm=model.mesh.comm)
        sizes, counts = table[:n], table[2 * n:3 * n]
        if (sizes != -table[n:2 * n]).any() or (counts != -table[3 * n:]).any():
            bad = int(np.argmax((sizes != -table[n:2 * n]) | (counts != -table[3 * n:])))
            raise ValueError(
                f"local batch sizes differ between the pp and tp ranks of dp index {bad} (from "
                f"{-table[n + bad]} to {sizes[bad]}); every pp and tp rank of a dp index must "
                "get the same samples"
            )
        check_local_sizes(sizes, self.config.micro_batches)
        self.batch_counts = [int(c) for c in counts]
        return b, int(counts.sum())

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

        Collective over the mesh: every rank passes its dp index's slice of the global
        batch (the slices may differ in size: each rank's loss and gradient are sums over
        its samples divided by the global batch's count, and gradients are summed over the
        ranks, so any split gives the same step). The returned loss is the loss of the
        whole global batch, identical on every rank.
        """
        model = self._resolve(model)
        before = self.hook.bytes_sent
        self.step_entry = (self.step_count, None if self.sampler is None else self.sampler.step)
        set_step(self.step_count + 1)  # what MPI calls record (the flight recorder)
        try:
            pending = in_flight()  # save(async_=True): committed once every rank wrote it
            if pending is not None and pending.owner is self:
                with phase("checkpoint"):
                    pending.poll(self.step_count)
            with phase("optimizer"):  # forward_backward marks its own phases inside
                red = self.redundancy
                if red is not None and not red.ready(self, self.step_count + 1):
                    red.establish(self, self.step_count + 1)
                loss = self.hook.step(self, model, batch)
        except ProcessFailure as lost:  # the recovery abandons a save in flight
            raise self.recover(lost) from lost
        except Exception as exc:  # a check failed on a dead rank's garbage: a lost rank
            lost = failure_behind(exc)
            if lost is None:
                raise
            raise self.recover(lost) from exc
        recorder.step_done(self.step_count)
        self.bytes_sent_last_step = self.hook.bytes_sent - before
        return loss

    def sync_step(self, model: ShardedModel, batch: tuple[Any, Any]) -> float:
        """The synchronous step: gradients reduced during backward, clipped, the shards
        updated, the parameters regathered. Collective over the mesh."""
        x, y = batch
        t0 = time.perf_counter()
        local_loss = self.forward_backward(model, x, y)
        t1 = time.perf_counter()
        with span("gradient sync", "optimizer"):
            model.finish_gradient_sync()
        t2 = time.perf_counter()
        red, tag = self.redundancy, self.step_count + 1
        if red is not None:  # the own snapshot (and the gradient shard to the copy's holder)
            red.before_update(self, tag)
        scale, skip = self._unscale(model)
        if self.config.max_grad_norm is not None and not skip:
            scale *= self.clip_factor(scale * float(np.sqrt(model.grad_sq_norm())))
        with phase("update"):
            if not skip:
                self.apply_update(scale)
            if red is not None:  # the neighbour's copy, updated alike
                red.after_update(self, tag, scale, skip)
        t3 = time.perf_counter()
        if not skip:
            with phase("allgather"):  # levels 1-2: the updated shards to every replica
                model.after_update()
        loss = self.global_loss(model, local_loss)
        t4 = time.perf_counter()
        self.step_count += 1
        self.timers["compute"] += t1 - t0
        self.timers["communication"] += (t2 - t1) + (t4 - t3)
        self.timers["update"] += t3 - t2
        return loss

    # The public pieces of a step, which the hooks' own steps are built from.
    def forward_backward(self, model: ShardedModel, x: Any, y: Any, *,
                         progress: Callable[[], None] | None = None) -> float:
        """Validate the batch, then forward and backward of every micro-batch (through the
        pipeline schedule when pp > 1), gradients synchronised during the last one;
        ``progress`` is called after each micro-batch. Returns this rank's share of the
        loss (0.0 off the last pipeline stage). Collective over the mesh."""
        with phase("forward"):
            b, normalizer = self._check_batch(model, x, y)
        m = self.config.micro_batches
        cuts = split_points(b, m)
        model.zero_grad()
        model.sync_compute_parameters()
        self.batch_share = (self._count(y, self.loss), normalizer)
        xs = [x[lo:hi] for lo, hi in zip(cuts, cuts[1:], strict=False)]
        ys = [y[lo:hi] for lo, hi in zip(cuts, cuts[1:], strict=False)]
        if model.pp_size > 1:
            return self._run_pipeline(model, xs, ys, normalizer=normalizer)
        loss = self._stage_loss(model)
        local_loss = 0.0
        for i in range(m):
            with model.sync_context(last=i == m - 1):
                with phase("forward"):
                    out = model.forward(xs[i], ctx=i)
                    local_loss += loss.forward(out, ys[i], normalizer=normalizer, ctx=i)
                with phase("backward"):
                    model.backward(loss.backward(ctx=i), ctx=i)
            if progress is not None:
                progress()
        return local_loss

    def _run_pipeline(self, model: ShardedModel, inputs: list[Any], targets: list[Any], *,
                      normalizer: float, train: bool = True) -> float:
        """Every micro-batch through the pipeline schedule; gradients synchronised over dp
        during the last backward. Collective over the mesh. Returns the sum of the
        micro-batch losses on the last stage, 0.0 on the others."""
        m = len(inputs)

        ahead = "forward" if train else "evaluation"

        def forward(x: Any, i: int, chunk: int | None = None) -> Any:
            with phase(ahead):
                return model.forward(x, ctx=i, chunk=chunk)

        def backward(dy: Any, i: int, chunk: int | None = None) -> Any:
            # every chunk's last backward is micro-batch m - 1 (chunk 0's the step's last)
            with model.sync_context(last=(i == m - 1)), phase("backward"):
                return model.backward(dy, ctx=i, chunk=chunk)

        weight: Callable[[int], None] | None = None
        if self.schedule == "zero-bubble":  # B now (no sync needed: W add the gradients,
            # and finish_gradient_sync reduces them after the step's last W)
            def backward(dy: Any, i: int) -> Any:  # noqa: F811
                with phase("backward"):
                    return model.backward_input(dy, ctx=i)

            def weight(i: int) -> None:
                with phase("backward"):
                    model.backward_weight(ctx=i)

        runner = PipelineStage(forward, backward, comm=model.pp_comm,
                               loss=self._stage_loss(model), backward_weight=weight,
                               virtual_stages=len(model.chunks), xp=model.xp)
        with phase("pipeline" if train else "evaluation"):  # the messages between stages
            total = runner.run(inputs, targets, schedule=self.schedule,
                               normalizer=normalizer, train=train)
        if train:
            model.last_pipeline_stats = runner.stats
        else:  # evaluation keeps no activations
            model.clear_cache()
            model.stage_loss(self.loss).clear_cache()
        return total

    def _stage_loss(self, model: ShardedModel) -> Any:
        loss = model.stage_loss(self.loss)
        return loss if self.scaler is None else ScaledLoss(loss, self.scaler)

    def _unscale(self, model: ShardedModel) -> tuple[float, bool]:
        """``(1/S, skip)``: the factor that undoes this step's loss scale ``S``, and
        whether the step is skipped (its gradients hold an inf or NaN: the scale backs
        off). ``(1.0, False)`` without loss scaling. Collective over the mesh."""
        if self.scaler is None:
            return 1.0, False
        used = self.scaler.scale
        bad = self.scaler.found_nonfinite([g for _, g, _ in self.pieces], model.mesh.comm)
        return 1.0 / used, self.scaler.update(bad)

    def lr(self) -> float | None:
        """This step's learning rate from the schedule (None: the optimizer's own)."""
        return self.lr_schedule(self.step_count) if self.lr_schedule is not None else None

    def clip_factor(self, norm: float) -> float:
        """The clipping factor ``min(1, max_norm / (norm + 1e-6))`` (torch's) for a
        gradient of global norm ``norm``."""
        if self.config.max_grad_norm is None:
            return 1.0
        return clip_coefficient(self.config.max_grad_norm, norm)

    def apply_update(self, scale: float) -> None:
        """One fused kernel update of every local piece with ``grad_scale=scale``."""
        lr = self.lr()
        for p, g, st in self.pieces:
            self.base.update(p, g, st, grad_scale=scale, lr=lr)
        self._require_state()
        self.state.step = self.pieces[0][2].step if self.pieces else self.state.step + 1

    def global_loss(self, model: ShardedModel, local_loss: float) -> float:
        """The global batch's loss from every rank's share (the last stage's, summed over
        the pp and dp groups). Collective over the mesh."""
        loss = np.array([local_loss])
        C.allreduce(loss, "sum", comm=model.loss_comm)
        return float(loss[0])

    def optimize(self, model: Any, data: Any, steps: int, *, global_batch_size: int,
                 seed: int = 0, sampler: Any = None, callback: Any = None
                 ) -> OptimizationResult:
        """Train for ``steps`` steps on ``data`` (anything with ``len`` and ``batch(idx)``).

        Collective over the dp group. Where a lost rank is recovered from in the job (see
        ``redundancy``), the survivors redo the interrupted step and go on: the result is
        the one the run would have had without the failure, and :attr:`model` is the
        survivors' model. Batches come from a
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
        first = self.step_count

        class _Record:
            def after_step(self, model: Any, rec: Any) -> None:
                result.losses.append(rec.loss)
                result.steps += 1
                result.samples += rec.samples
                result.tokens += rec.tokens
                if callback is not None:
                    callback(rec.step, rec.loss)

            def mesh_changed(self, model: Any, changed: Any) -> None:
                # a lost rank: the steps after changed.step are redone (and recorded again)
                drop = max(0, len(result.losses) - (changed.step - first))
                if drop:
                    share = result.samples // max(result.steps, 1), \
                        result.tokens // max(result.steps, 1)
                    del result.losses[len(result.losses) - drop:]
                    result.steps -= drop
                    result.samples -= drop * share[0]
                    result.tokens -= drop * share[1]

        t0 = time.perf_counter()
        run_steps(self, model, data, until=self.step_count + int(steps), sampler=sampler,
                  hooks=[_Record()])
        result.seconds = time.perf_counter() - t0
        return result

    def evaluate(self, model: Any, data: Any, *, batches: int, global_batch_size: int,
                 seed: int = 0) -> float:
        """Mean loss over ``batches`` fixed global batches of ``data`` (no update; through
        the pipeline when pp > 1).

        Collective over the mesh; the same batches at every mesh shape (they come from a
        sampler seeded with ``seed``), so validation losses are comparable across runs and
        world sizes.
        """
        with phase("evaluation"):
            return self._evaluate(self._resolve(model), data, batches=batches,
                                  global_batch_size=global_batch_size, seed=seed)

    def _evaluate(self, model: ShardedModel, data: Any, *, batches: int,
                  global_batch_size: int, seed: int) -> float:
        from mpidist.data import GlobalBatchSampler

        model.sync_compute_parameters()
        own = getattr(data, "eval_sampler", None)  # a blend draws its sources in proportion
        sampler = own(global_batch_size, seed) if own is not None else \
            GlobalBatchSampler(len(data), global_batch_size, seed=seed)
        loss = model.stage_loss(self.loss)
        total = np.zeros(1)
        for step in range(batches):
            x, y = data.batch(sampler.local_indices(step, model.dp_rank, model.dp_size))
            normalizer = self._eval_count(y, global_batch_size) * batches
            if model.pp_size > 1:
                total[0] += self._run_pipeline(model, [x], [y], normalizer=normalizer,
                                               train=False)
                continue
            out = model.forward(x, ctx="eval")
            total[0] += loss.forward(out, y, normalizer=normalizer, ctx="eval")
            model.clear_cache()
            loss.clear_cache()
        C.allreduce(total, "sum", comm=model.loss_comm)
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
        for _, _, st in self.pieces:
            st.step = self.state.step

    def memory_report(self) -> dict[str, int]:
        """Per-rank bytes of parameters, gradients, optimizer state, the working set and
        the hook's own state."""
        model = self._require_model()
        out = model.memory_report()
        out["optimizer_state"] = int(sum(b.nbytes for b in self.state.buffers.values()))
        out["total"] = out["parameters"] + out["gradients"] + out["optimizer_state"]
        extra = self.hook.extra_memory()
        if self.redundancy is not None:  # the snapshot and the buddy's copy (host memory)
            extra["redundancy"] = self.redundancy.nbytes()
        out.update(extra)
        out["total"] += sum(extra.values())
        return out

    def state_dict(self) -> dict[str, Any]:
        """The parameters and optimizer state as whole named tensors (the hook may take
        them its way: Local SGD's replica average, async after a flush). Collective."""
        return self.hook.state_dict(self, super().state_dict)

    # -- bytes sent by the metered hooks --------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has passed to MPI for gradient/parameter exchange since wrap
        (metered hooks: compression, Local SGD, async; 0 for the others)."""
        return self.hook.bytes_sent

    @property
    def bytes_sent_per_step(self) -> float:
        """Mean bytes sent per step since wrap (:attr:`bytes_sent` / steps)."""
        return self.bytes_sent / self.step_count if self.step_count else 0.0

    # -- the hook's per-rank state in checkpoints (see mpidist.checkpoint.training) ----------
    def strategy_state_attrs(self) -> dict[str, Any]:
        """What the checkpoint records about the hook's state (JSON). Collective over dp
        for hooks with exchanges in flight."""
        return self.hook.state_attrs(self._require_model())

    def strategy_state_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return self.hook.state_tensors(self._require_model())

    def strategy_state_pieces(self, *, for_writing: bool) -> list[tuple[str, slice, np.ndarray]]:
        return self.hook.state_pieces(self._require_model(), for_writing=for_writing)

    def prepare_strategy_state(self, attrs: dict[str, Any] | None) -> bool:
        return self.hook.prepare_state(self._require_model(), attrs)

    def finish_strategy_state(self) -> None:
        self.hook.finish_state(self._require_model())

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient synchronisation inside (see ``ShardedModel.no_sync``)."""
        model = self._require_model()
        with model.no_sync():
            yield
