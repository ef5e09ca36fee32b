"""3D parallelism: pipeline × data × tensor on the Cartesian mesh (HybridShardedOptimizer).

One step on a mesh of ``pp × dp × tp`` ranks (design idea 3):

1. every dp rank takes its slice of the global batch (all pp and tp ranks of one dp index
   see the same samples; slices differ by at most one sample when dp does not divide the
   batch) and splits it into ``config.micro_batches`` micro-batches (likewise);
2. the pp stages run the micro-batches through a GPipe or 1F1B schedule
   (:mod:`mpidist.parallel.pipeline`); inside a stage, the tensor-parallel layers of
   :mod:`mpidist.nn.tensor_parallel` communicate over tp; gradients accumulate over the
   micro-batches;
3. gradients are reduced over dp, with the storage of the chosen ZeRO stage: 0 (DDP:
   bucketed allreduce during the last backward), 1 (allreduce, sharded update, parameter
   allgather) or 2 (unit-wise reduce-scatter, sharded update, allgather);
4. clipping uses the global norm over the whole mesh — a tp-sharded tensor counts each
   slice once, a tp-replicated tensor (LayerNorm, row-parallel bias, position embedding)
   once (from tp rank 0), each dp shard once, summed over the pp stages: one allreduce of a
   scalar;
5. the fused kernel updates the local shard; the returned loss is the global-batch loss on
   every rank.

Tp-replicated parameters need no extra communication: in the Megatron layout their inputs
and output gradients are identical on all tp ranks (the copy/reduce mappings make them so),
so their gradients, and hence their updates, are identical too.

State dicts hold FULL global tensors under the single-process names, so a hybrid state dict
loads into DDP (and any other strategy or mesh) and vice versa.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from mpidist import collectives as C
from mpidist.buffers import ShardedLayout
from mpidist.comms import world
from mpidist.data.sampler import check_local_sizes, split_points
from mpidist.mesh import MeshShape, resolve_shape
from mpidist.parallel.config import ShardingConfiguration
from mpidist.parallel.ddp import DDPModel, ZeRO1Model
from mpidist.parallel.engine import ShardedModel, ShardedOptimizer, units_of
from mpidist.parallel.pipeline import BALANCES, PipelineStage, check_schedule, partition_units
from mpidist.parallel.zero import ZeRO2Model, ZeRO3Model

__all__ = [
    "HybridDDPModel",
    "HybridModel",
    "HybridShardedOptimizer",
    "HybridZeRO1Model",
    "HybridZeRO2Model",
    "HybridZeRO3Model",
    "resolve_hybrid_shape",
]


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{what}={v!r} must be an integer")
    return int(v)


def resolve_hybrid_shape(config: ShardingConfiguration, comm: Any = None, pp: int = 1,
                         tp: int = 1, dp: int = -1) -> MeshShape:
    """The mesh sizes of a hybrid run. Pure (reads the communicator's size only).

    With ``config.mesh`` the sizes come from the mesh; sizes given as well must agree
    (the defaults pp=1, tp=1, dp=-1 all together mean "whatever the mesh has"). Otherwise
    they are checked against the size of ``comm`` (default ``MPI.COMM_WORLD``).
    ValueError naming the values on a mismatch, identically on every rank.
    """
    pp, tp, dp = _int(pp, "pipeline_parallel_size"), _int(tp, "tensor_parallel_size"), \
        _int(dp, "data_parallel_size")
    mesh = config.mesh
    if mesh is not None:
        s = mesh.shape
        if (pp, tp, dp) != (1, 1, -1) and (
                (pp, tp) != (s.pp, s.tp) or dp not in (-1, s.dp)):
            raise ValueError(
                f"pipeline_parallel_size={pp}, tensor_parallel_size={tp}, "
                f"data_parallel_size={dp} do not match config.mesh (pp={s.pp}, dp={s.dp}, "
                f"tp={s.tp})"
            )
        return s
    return resolve_shape(world(comm).Get_size(), pp, tp, dp)


def _is_gpt(module: Any) -> bool:
    from mpidist.nn import GPT

    return isinstance(module, GPT)


class HybridModel(ShardedModel):
    """This rank's part of a model on a (pp, dp, tp) mesh: its pipeline stage's units, in
    their tensor-parallel form when tp > 1, in the flat storage of a ZeRO stage over dp.

    Use a concrete subclass (:class:`HybridDDPModel`, :class:`HybridZeRO1Model`,
    :class:`HybridZeRO2Model`; ``HybridShardedOptimizer.wrap`` picks one). Construction is
    collective over the mesh; every check of the arguments (sizes against the world, tp
    against the GPT's n_head/n_embd/vocab_size, pp against the units, tied weights with
    pp > 1) raises ValueError on every rank before any communication.

    Args:
        module: the single-process model (an :class:`mpidist.nn.GPT` for tp > 1; any model
            with ``units`` otherwise). With tp > 1 the tensor-parallel GPT is built from its
            config; parameter names stay the single-process names.
        config: the :class:`ShardingConfiguration`; ``config.mesh`` or the sizes below.
        seed: initial values depend only on (seed, name): every rank's slices equal slices
            of the single-process model.
        pipeline_parallel_size, tensor_parallel_size, data_parallel_size: mesh sizes.
        balance: "uniform" (units per stage) or "parameters" (parameter count per stage).
        comm: the communicator to build the mesh on when ``config.mesh`` is None.
    """

    strategy: ClassVar[str] = "hybrid"

    def __init__(self, module: Any, config: ShardingConfiguration | None = None, *,
                 seed: int = 0, pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1,
                 data_parallel_size: int = -1, balance: str = "uniform", comm: Any = None
                 ) -> None:
        from mpidist.mesh import ProcessMesh
        from mpidist.nn.tensor_parallel import check_tensor_parallel_gpt, tp_partitions

        self.config = config if config is not None else ShardingConfiguration()
        self.module = module
        self.seed = int(seed)
        # -- checks: pure, identical on every rank -------------------------------------------
        shape = resolve_hybrid_shape(self.config, comm, pipeline_parallel_size,
                                     tensor_parallel_size, data_parallel_size)
        self.pp_size, self.dp_size, self.tp_size = shape.pp, shape.dp, shape.tp
        if balance not in BALANCES:
            raise ValueError(f"balance={balance!r} is not one of {BALANCES}")
        global_units = units_of(module)
        self.units = global_units
        self._check_units()
        if self.tp_size > 1:
            if not _is_gpt(module):
                raise ValueError(
                    f"tensor_parallel_size={self.tp_size} needs an mpidist.nn.GPT; got "
                    f"{type(module).__name__}"
                )
            check_tensor_parallel_gpt(module.config, self.tp_size)
        users: dict[str, int] = {}
        for u in global_units:
            for n in u.parameter_names(include_shared=True):
                users[n] = users.get(n, 0) + 1
        tied = sorted(n for n, k in users.items() if k > 1)
        if tied and self.pp_size > 1:
            raise ValueError(
                f"pipeline_parallel_size={self.pp_size} with weights shared between units "
                f"(tie_weights) is not supported: {tied}; use untied weights or pp=1"
            )
        weights = [sum(int(np.prod(s)) for _, s in u.named_parameter_shapes())
                   for u in global_units]
        self.bounds = partition_units(weights, self.pp_size, balance)
        self.balance = balance
        # Global bookkeeping (single-process names and shapes), for whole-tensor state.
        self.global_shapes = {n: tuple(s) for n, s in module.named_parameter_shapes()}
        self._global_layout = ShardedLayout(
            [u.named_parameter_shapes() for u in global_units], 1, 0)
        self.stage_names = [
            [n for u in global_units[a:b] for n, _ in u.named_parameter_shapes()]
            for a, b in self.bounds
        ]
        # -- communicators (collective from here on) --------------------------------------------
        if self.config.mesh is None:
            self.mesh = ProcessMesh(comm, pp=self.pp_size, tp=self.tp_size, dp=self.dp_size)
            self._owns_mesh = True
        else:
            self.mesh = self.config.mesh
            self._owns_mesh = False
        self.comm = self.mesh.group("dp")
        self.tp_comm = self.mesh.group("tp")
        self.pp_comm = self.mesh.group("pp")
        self.loss_comm = self.mesh.group(("pp", "dp"))
        self.dp_rank = self.mesh.coords["dp"]
        self.tp_rank = self.mesh.coords["tp"]
        self.stage = self.mesh.coords["pp"]
        self.dtype = self.config.np_dtype
        # -- this rank's units --------------------------------------------------------------------
        if self.tp_size > 1:
            from mpidist.nn.tensor_parallel import TensorParallelGPT

            self.local_module = TensorParallelGPT(module.config, comm=self.tp_comm)
        else:
            self.local_module = module
        a, b = self.bounds[self.stage]
        self.units = units_of(self.local_module)[a:b]
        self.partitions = {n: v for n, v in tp_partitions(self.local_module).items()
                           if n in set(self.stage_names[self.stage])}
        self.layout = ShardedLayout(
            [u.named_parameter_shapes() for u in self.units], self.dp_size, self.dp_rank
        )
        self._users = self._tensor_users()
        self.memory = {"parameters": 0, "gradients": 0, "working_peak": 0}
        self._working = 0
        self._sync_enabled = True
        self._loss_cache: tuple[Any, Any] | None = None
        self.last_pipeline_stats: Any = None
        self._allocate()
        self._initialize()
        self._bind()
        self._norm_mask = self._make_norm_mask()

    # -- storage hooks shared by the subclasses -------------------------------------------------
    def _bind_units(self, grads: np.ndarray | None) -> None:
        pviews = self.layout.full_views(self.params)
        gviews = None if grads is None else self.layout.full_views(grads)
        for unit in self.units:
            unit.bind(pviews, gviews)

    def _make_norm_mask(self) -> np.ndarray:
        # 1 where this rank's local shard counts towards the global norm: tp-sharded
        # tensors on every tp rank, tp-replicated ones on tp rank 0 only.
        mask = np.zeros(self.layout.local_size, dtype=self.dtype)
        for name, _, in_local in self.layout.local_pieces():
            if name in self.partitions or self.tp_rank == 0:
                mask[in_local] = 1
        return mask

    def _local_grad(self, u: int) -> np.ndarray:
        """This rank's dp shard of unit u's synchronised gradients."""
        if hasattr(self, "grad_shard"):
            return self.layout.unit_local(u, self.grad_shard)
        return self.layout.unit_shard_of_full(u, self.grads)

    def grad_sq_norm(self) -> float:
        """Squared global gradient norm over the whole mesh. Collective over the mesh."""
        total = 0.0
        for u in range(len(self.layout.units)):
            g = self._local_grad(u)
            w = self.layout.unit_local(u, self._norm_mask)
            total += float(np.dot(g * w, g))
        buf = np.array([total])
        C.allreduce(buf, "sum", comm=self.mesh.comm)
        return float(buf[0])

    # -- the pipeline ----------------------------------------------------------------------
    def stage_loss(self, loss: Any) -> Any:
        """The loss the last stage runs: with tp > 1 a :class:`CrossEntropyLoss` becomes the
        vocab-parallel cross-entropy over tp (same value, vocabulary-sharded logits)."""
        if self.tp_size == 1:
            return loss
        from mpidist.nn import CrossEntropyLoss
        from mpidist.nn.tensor_parallel import VocabParallelCrossEntropy

        if not isinstance(loss, CrossEntropyLoss):
            raise ValueError(
                f"tensor_parallel_size={self.tp_size} needs CrossEntropyLoss (computed "
                f"vocab-parallel); got {type(loss).__name__}"
            )
        if self._loss_cache is None or self._loss_cache[0] is not loss:
            self._loss_cache = (loss, VocabParallelCrossEntropy(
                self.tp_comm, self.local_module.config.vocab_size))
        return self._loss_cache[1]

    def run_pipeline(self, inputs: list[Any], targets: list[Any], loss: Any, *,
                     normalizer: float, schedule: str = "1f1b", train: bool = True) -> float:
        """Forward and backward of every micro-batch through the pipeline; gradients are
        accumulated and synchronised over dp after the last micro-batch's backward.

        Collective over the mesh. Returns the sum of the micro-batch losses on the last
        stage, 0.0 on the others.
        """
        m = len(inputs)

        def backward(dy: Any, i: int) -> Any:
            with self.sync_context(last=(i == m - 1)):
                return self.backward(dy, ctx=i)

        runner = PipelineStage(self.forward, backward, comm=self.pp_comm,
                               loss=self.stage_loss(loss))
        total = runner.run(inputs, targets, schedule=schedule, normalizer=normalizer,
                           train=train)
        if train:
            self.last_pipeline_stats = runner.stats
        else:  # evaluation keeps no activations
            self.local_module.clear_cache()
            self.stage_loss(loss).clear_cache()
        return total

    # -- whole tensors ------------------------------------------------------------------------
    def tp_partition(self, name: str) -> tuple[int, int, int, int] | None:
        """``TPPartition(axis, start, stop, groups)`` of tensor ``name`` on this rank (see
        :class:`mpidist.nn.tensor_parallel.TPPartition`), or None when the tensor is whole
        on this rank (tp-replicated, or tp=1). Pure."""
        entry = self.partitions.get(name)
        return None if entry is None else entry[0]

    def stage_of(self, name: str) -> int:
        """The pipeline stage holding tensor ``name``. Pure."""
        for s, names in enumerate(self.stage_names):
            if name in names:
                return s
        raise KeyError(f"no tensor named {name!r}")

    def global_tensors(self, full: np.ndarray) -> dict[str, np.ndarray]:
        """Every tensor of the model, global and unsharded, from this stage's full-layout
        array (parameters, or a state array from :meth:`gather_state`).

        Collective over tp (one allgather of the sharded tensors) and pp (one broadcast per
        stage). The same dict on every rank.
        """
        views = self.layout.full_views(full)
        names = self.stage_names[self.stage]
        out: dict[str, np.ndarray] = {n: np.array(views[n]) for n in names
                                      if n not in self.partitions}
        sharded = [n for n in names if n in self.partitions]
        if sharded:
            flat = np.concatenate([views[n].reshape(-1) for n in sharded])
            every = C.allgather(flat, comm=self.tp_comm).reshape(self.tp_size, -1)
            for n in sharded:
                out[n] = np.empty(self.global_shapes[n], dtype=full.dtype)
            for r in range(self.tp_size):
                off = 0
                for n in sharded:
                    part, gshape = self.partitions[n]
                    k = views[n].size
                    out[n][part.for_rank(r).index(gshape)] = \
                        every[r, off:off + k].reshape(views[n].shape)
                    off += k
        if self.pp_size > 1:
            for s, stage_names in enumerate(self.stage_names):
                sizes = [int(np.prod(self.global_shapes[n])) for n in stage_names]
                if s == self.stage:
                    buf = np.concatenate([out[n].reshape(-1) for n in stage_names])
                else:
                    buf = np.empty(sum(sizes), dtype=full.dtype)
                C.broadcast(buf, s, comm=self.pp_comm)
                off = 0
                for n, k in zip(stage_names, sizes, strict=True):
                    out[n] = buf[off:off + k].reshape(self.global_shapes[n])
                    off += k
        return {n: out[n] for n in self.global_shapes}

    def local_full(self, tensors: dict[str, np.ndarray], dtype: np.dtype) -> np.ndarray:
        """This stage's full-layout array holding this rank's slices of global tensors.
        Not collective."""
        full = np.zeros(self.layout.full_size, dtype=dtype)
        views = self.layout.full_views(full)
        for n in self.stage_names[self.stage]:
            src = np.asarray(tensors[n])
            entry = self.partitions.get(n)
            views[n][...] = src if entry is None else entry[0].take(src)
        return full

    def checkpoint_pieces(self, state_buffers: dict[str, np.ndarray], *, for_writing: bool
                          ) -> list[tuple[str, slice, np.ndarray]]:
        """``(checkpoint name, flat slice of the global tensor, 1-D data)`` of this rank.

        For writing, every element of every global tensor is owned by exactly one rank of
        the mesh: its pipeline stage, then tp rank 0 for tp-replicated tensors (each tp rank
        for its own slice of a split tensor), then the dp shard. For reading, each rank asks
        for everything its storage holds. A tp slice that is not contiguous in the global
        tensor (a column block) becomes one piece per contiguous run. Not collective.
        """
        out: list[tuple[str, slice, np.ndarray]] = []

        def emit(prefix: str, name: str, ts: slice, data: np.ndarray) -> None:
            entry = self.partitions.get(name)
            if entry is None:
                out.append((prefix + name, ts, data))
                return
            gshape = self.global_shapes[name]
            idx = np.arange(int(np.prod(gshape)), dtype=np.int64).reshape(gshape)
            idx = idx[entry[0].index(gshape)].reshape(-1)[ts]
            cuts = np.flatnonzero(np.diff(idx) != 1) + 1
            for a, b in zip(np.r_[0, cuts], np.r_[cuts, idx.size], strict=True):
                out.append((prefix + name, slice(int(idx[a]), int(idx[b - 1]) + 1), data[a:b]))

        def add(prefix: str, array: np.ndarray, sharded: bool) -> None:
            for name, ts, data in self.tensor_pieces(array, sharded=sharded, owned=for_writing):
                if for_writing and self.tp_rank != 0 and name not in self.partitions:
                    continue
                emit(prefix, name, ts, data)

        add("params/", self.parameter_storage, self.shards_params)
        for key, buf in state_buffers.items():
            add(f"optimizer/{key}/", buf, self.shards_state)
        return out

    @property
    def global_layout(self) -> ShardedLayout:
        """The single-process layout of the whole model (all stages, unsplit tensors)."""
        return self._global_layout

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.global_shapes)

    def state_tensors(self, local: np.ndarray) -> dict[str, np.ndarray]:
        """A state array as whole global tensors of every stage. Collective over the mesh."""
        return self.global_tensors(self.gather_state(local))

    def load_state_tensors(self, tensors: dict[str, np.ndarray], local: np.ndarray) -> None:
        self.scatter_state(self.local_full(tensors, local.dtype), local)

    def full_parameters(self) -> dict[str, np.ndarray]:
        """Every parameter as a global array. Collective over the mesh."""
        return self.global_tensors(self.params)

    def load_full_parameters(self, params: dict[str, np.ndarray]) -> None:
        """Take this rank's slices of global parameter arrays. Not collective."""
        self.params[...] = self.local_full(params, self.dtype)

    def __repr__(self) -> str:
        a, b = self.bounds[self.stage]
        return (f"{type(self).__name__}({type(self.module).__name__}, stage={self.stage} "
                f"units[{a}:{b}], pp={self.pp_size}, dp={self.dp_size}, tp={self.tp_size}, "
                f"dtype={self.dtype})")


class HybridDDPModel(HybridModel, DDPModel):
    """Hybrid model with replicated storage over dp (ZeRO stage 0): DDP's bucketed
    allreduce during the last micro-batch's backward."""

    def _initialize(self) -> None:
        # Initialise through the stage's full views rather than unit by unit
        # (ShardedModel._init_unit), so a unit reading a tied weight owned by another unit
        # can be bound.
        views = self.layout.full_views(self.params)
        for unit in self.units:
            unit.bind(views, None)
            unit.init_parameters(self.seed)
            unit.unbind()
        C.broadcast(self.params, 0, comm=self.comm)

    def _bind(self) -> None:
        self._bind_units(self.grads)


class HybridZeRO1Model(HybridDDPModel, ZeRO1Model):
    """Hybrid model with ZeRO-1 over dp: allreduced gradients, sharded optimizer state,
    parameter allgather after the update."""


class HybridZeRO2Model(HybridModel, ZeRO2Model):
    """Hybrid model with ZeRO-2 over dp: each unit's gradients reduce-scattered during
    every backward, sharded optimizer state, parameter allgather after the update."""

    def _bind(self) -> None:
        self._bind_units(None)


class HybridZeRO3Model(HybridModel, ZeRO3Model):
    """Hybrid model with ZeRO-3 over dp: each stage keeps only its dp shard of its
    parameters; every unit is allgathered over dp just in time for its forward and again
    for its backward (the next one prefetched), its gradients reduce-scattered straight
    into the local shard. Tensor-parallel units gather their own tp slice."""

    def _initialize(self) -> None:
        # Every rank initialises its stage's full layout (values depend on (seed, name)
        # only) and keeps its shard: no communication.
        full = np.zeros(self.layout.full_size, dtype=self.dtype)
        views = self.layout.full_views(full)
        for unit in self.units:
            unit.bind(views, None)
            unit.init_parameters(self.seed)
            unit.unbind()
        self.scatter_state(full, self.param_shard)

    def _bind(self) -> None:
        """Units are bound to gathered buffers during forward and backward only."""

    def full_parameters(self) -> dict[str, np.ndarray]:
        """Every parameter as a global array. Collective over the mesh."""
        return self.global_tensors(self.gather_state(self.param_shard))

    def load_full_parameters(self, params: dict[str, np.ndarray]) -> None:
        """Take this rank's shard of global parameter arrays. Not collective."""
        self.scatter_state(self.local_full(params, self.dtype), self.param_shard)


_MODELS: dict[int, type[HybridModel]] = {0: HybridDDPModel, 1: HybridZeRO1Model,
                                          2: HybridZeRO2Model, 3: HybridZeRO3Model}


class HybridShardedOptimizer(ShardedOptimizer):
    """3D-parallel training (pipeline × data × tensor) with optional ZeRO over dp.

    Args:
        base: the optimizer whose fused kernel updates each shard (``mpidist.optim``).
        config: :class:`ShardingConfiguration`; ``config.mesh`` (a ProcessMesh with the
            sizes) or the sizes below; ``micro_batches`` micro-batches per step run through
            the pipeline; ``max_grad_norm`` clips by the norm over the whole mesh.
        pipeline_parallel_size, tensor_parallel_size: pp and tp sizes.
        data_parallel_size: dp size; -1 infers it from the world size.
        zero_stage: 0 (replicated, allreduce), 1 (sharded optimizer state), 2 (sharded
            gradients too) or 3 (sharded parameters too, gathered unit by unit) over dp.
        schedule: "1f1b" (default) or "gpipe".
        balance: stage split, "uniform" (units) or "parameters" (parameter count).
        comm: communicator to build the mesh on when ``config.mesh`` is None
            (default ``MPI.COMM_WORLD``).
        loss, lr_schedule: as for every strategy (with tp > 1 the loss must be
            :class:`~mpidist.nn.CrossEntropyLoss`, run vocab-parallel).

    Construction is pure and raises ValueError (same on every rank) for sizes that do not
    match the world or the mesh, a bad zero_stage, schedule or balance.
    """

    model_class = HybridModel

    def __init__(self, base: Any, config: ShardingConfiguration | None = None,
                 pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1,
                 data_parallel_size: int = -1, zero_stage: int = 0, *,
                 schedule: str = "1f1b", balance: str = "uniform", comm: Any = None,
                 loss: Any = None, lr_schedule: Any = None) -> None:
        super().__init__(base, config, loss=loss, lr_schedule=lr_schedule)
        zero_stage = _int(zero_stage, "zero_stage")
        if zero_stage not in _MODELS:
            raise ValueError(f"zero_stage={zero_stage} must be 0, 1, 2 or 3")
        if balance not in BALANCES:
            raise ValueError(f"balance={balance!r} is not one of {BALANCES}")
        self.zero_stage = zero_stage
        self.schedule = check_schedule(schedule)
        self.balance = balance
        self.comm = comm
        self.shape = resolve_hybrid_shape(self.config, comm, pipeline_parallel_size,
                                          tensor_parallel_size, data_parallel_size)

    @property
    def pipeline_parallel_size(self) -> int:
        return self.shape.pp

    @property
    def tensor_parallel_size(self) -> int:
        return self.shape.tp

    @property
    def data_parallel_size(self) -> int:
        return self.shape.dp

    def wrap(self, module: Any, *, seed: int = 0) -> HybridModel:
        """Build this rank's stage (tensor-parallel when tp > 1) of ``module`` and the
        optimizer state. Collective over the mesh; ValueError before any communication
        for a model that does not fit the mesh."""
        if self.shape.tp > 1:
            from mpidist.nn import CrossEntropyLoss

            if not isinstance(self.loss, CrossEntropyLoss):
                raise ValueError(
                    f"tensor_parallel_size={self.shape.tp} needs CrossEntropyLoss; got "
                    f"{type(self.loss).__name__}"
                )
        model = _MODELS[self.zero_stage](
            module, self.config, seed=seed, pipeline_parallel_size=self.shape.pp,
            tensor_parallel_size=self.shape.tp, data_parallel_size=self.shape.dp,
            balance=self.balance, comm=self.comm)
        self.attach(model)
        return model

    # -- one step ----------------------------------------------------------------------------
    def _hybrid(self, model: Any) -> HybridModel:
        """``model`` as the HybridModel this optimizer wrapped; TypeError otherwise."""
        if not isinstance(model, HybridModel):
            raise TypeError(f"{type(self).__name__} needs a HybridModel (wrap() first)")
        return model

    def _check_batch(self, model: ShardedModel, x: Any, y: Any) -> tuple[int, int]:
        """Local checks first (no communication), then one small allreduce over the mesh:
        every pp and tp rank of a dp index has the same local batch size, and each has at
        least ``micro_batches`` samples. Returns ``(b, total)``: this rank's sample count and
        the loss normaliser of the global batch (summed over the dp indices)."""
        b = len(x)
        if len(y) != b:
            raise ValueError(f"inputs have {b} samples but targets have {len(y)}")
        model = self._hybrid(model)
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
        return b, int(counts.sum())

    def _forward_backward(self, model: ShardedModel, x: Any, y: Any) -> float:
        """Every micro-batch through the pipeline schedule (forward and backward), gradients
        synchronised over dp during the last one. Collective over the mesh: every rank
        passes the local batch of its dp index (the same samples on all pp and tp ranks of
        that index). Returns the last stage's share of the loss, 0.0 on other stages."""
        model = self._hybrid(model)
        b, normalizer = self._check_batch(model, x, y)
        cuts = split_points(b, self.config.micro_batches)
        model.zero_grad()
        self.batch_share = (self._count(y, self.loss), normalizer)
        return model.run_pipeline(
            [x[lo:hi] for lo, hi in zip(cuts, cuts[1:], strict=False)],
            [y[lo:hi] for lo, hi in zip(cuts, cuts[1:], strict=False)],
            self.loss, normalizer=normalizer, schedule=self.schedule)

    def _loss_group(self, model: ShardedModel) -> Any:
        # Only the last stage has a loss (the same on its tp ranks): sum over pp and dp.
        return self._hybrid(model).loss_comm

    def evaluate(self, model: Any, data: Any, *, batches: int, global_batch_size: int,
                 seed: int = 0) -> float:
        """Mean loss over ``batches`` fixed global batches (forward only, through the
        pipeline). Collective over the mesh; the same batches at every mesh shape."""
        from mpidist.data import GlobalBatchSampler

        model = self._hybrid(self._resolve(model))
        sampler = GlobalBatchSampler(len(data), global_batch_size, seed=seed)
        total = np.zeros(1)
        for step in range(batches):
            x, y = data.batch(sampler.local_indices(step, model.dp_rank, model.dp_size))
            normalizer = self._eval_count(y, global_batch_size) * batches
            total[0] += model.run_pipeline([x], [y], self.loss, normalizer=normalizer,
                                           schedule=self.schedule, train=False)
        C.allreduce(total, "sum", comm=model.loss_comm)
        return float(total[0])
