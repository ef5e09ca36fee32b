"""The one sharded data-parallel component: a model on a (pp, dp, tp) mesh, sharded over dp
at a level, its gradients communicated by a hook.

:class:`ShardedModel` is what every strategy wraps a model in (design idea 11):

* tensor parallelism is applied first (``tp > 1``: the tensor-parallel form of the model,
  its split tensors listed by :func:`mpidist.nn.tensor_parallel.tp_partitions`);
* the units are cut into pipeline stages (:func:`~mpidist.parallel.pipeline.partition_units`)
  and this rank keeps its stage's (under the interleaved schedule its ``virtual_stages``
  chunks, one after the other in its flat layout: :mod:`mpidist.parallel.chunks`);
* the stage is sharded over the data-parallel group at ``level`` 0-3 — what is sharded:
  nothing (DDP), the optimizer state (ZeRO-1), and the gradients (ZeRO-2), and the
  parameters (ZeRO-3: each unit gathered just in time, the next one prefetched);
* its gradients go to a :class:`~mpidist.parallel.hooks.GradientHook` piece by piece as
  backward produces them: buckets of the full gradient at levels 0-1 (each started as soon
  as backward has filled it), units at levels 2-3 (their sum's shard kept).

Where every element lives is the :class:`~mpidist.parallel.placement.Placement`'s answer.
Loss convention: every rank normalises its local loss by the global count, so gradients
are summed, not averaged, over dp.

This module holds the construction (checks, communicators, storage, initial values) and
what the level shards; the forward and backward passes and the gradient synchronisation
are :class:`~mpidist.parallel.model_passes.ModelPasses`', the update, the pipeline's loss
and whole tensors :class:`~mpidist.parallel.model_tensors.ModelTensors`', the chunks and
the zero-bubble split :class:`~mpidist.parallel.chunks.StageChunks`' (all three mixed into
:class:`ShardedModel`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpidist.core import arrays
from mpidist.core import collectives as C
from mpidist.core.buffers import Bucket
from mpidist.core.comms import world
from mpidist.core.mesh import MeshShape, resolve_shape
from mpidist.parallel.chunks import StageChunks, chunk_spans
from mpidist.parallel.config import ShardingConfiguration
from mpidist.parallel.hooks import GradientHook, default_hook
from mpidist.parallel.model_passes import ModelPasses
from mpidist.parallel.model_tensors import ModelTensors
from mpidist.parallel.pipeline import BALANCES, cut_virtual_stages
from mpidist.parallel.placement import Placement
from mpidist.parallel.precision import check_placement, compute_dtype
from mpidist.parallel.tensor import tensor_parallel_styles

__all__ = ["ShardedModel", "has_units", "resolve_mesh_shape", "units_of"]


def units_of(module: Any) -> list[Any]:
    """The module's units (its ``units`` list; a module without one is one unit)."""
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


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{what}={v!r} must be an integer")
    return int(v)


def resolve_mesh_shape(config: ShardingConfiguration, comm: Any = None, pp: int = 1,
                       tp: int = 1, dp: int = -1) -> MeshShape:
    """The mesh sizes of a run. Pure (reads the communicator's size only).

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


def tensor_users(units: list[Any]) -> dict[str, list[int]]:
    """``{tensor name: the indices of the units that read it}`` (tied weights: several).
    Pure."""
    users: dict[str, list[int]] = {}
    for u, unit in enumerate(units):
        for name in unit.parameter_names(include_shared=True):
            users.setdefault(name, []).append(u)
    return users


class ShardedModel(ModelPasses, ModelTensors, StageChunks):
    """This rank's part of a model: its pipeline stage's units, in their tensor-parallel
    form when tp > 1, in the flat storage of sharding ``level`` over dp.

    Construction is collective over the mesh; every check of the arguments raises
    ValueError on every rank before any communication.

    Args:
        module: the single-process model (an :class:`mpidist.nn.GPT` for tp > 1; its
            ``units`` are run one at a time; a module without units is one unit).
        config: the :class:`ShardingConfiguration`; ``config.mesh`` or the sizes below.
        seed: initial values depend only on (seed, name), so every rank, strategy and mesh
            starts from slices of the same single-process model.
        level: 0-3, what is sharded over dp (see :data:`~mpidist.parallel.placement.LEVELS`).
        hook: the gradient communication (default: allreduce at levels 0-1, reduce-scatter
            at 2-3).
        pipeline_parallel_size, tensor_parallel_size, data_parallel_size: mesh sizes when
            ``config.mesh`` is None (built on ``comm``, default ``MPI.COMM_WORLD``).
        balance: pipeline stage split, "uniform" (units) or "parameters" (their size).
        tp_plan: the tensor-parallel plan (layer name pattern -> style, see
            :mod:`mpidist.nn.tp_plan`); default the model's own (GPT, MLP).
        initialize: False skips computing initial values (state is about to be moved in).
    """

    #: the level when none is given (the entry points DDPModel, ZeRO1Model... fix theirs)
    default_level = 0

    def __init__(self, module: Any, config: ShardingConfiguration | None = None, *,
                 seed: int = 0, level: int | None = None, hook: GradientHook | None = None,
                 pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1,
                 data_parallel_size: int = -1, balance: str = "uniform", comm: Any = None,
                 tp_plan: Any = None, initialize: bool = True) -> None:
        self.config = config if config is not None else ShardingConfiguration()
        self.module = module
        self.seed = int(seed)
        self.level = _int(self.default_level if level is None else level, "level")
        self.hook = hook if hook is not None else default_hook(self.level)
        self.tp_plan = tp_plan
        self.tp_styles: dict[str, Any] = {}
        shape = resolve_mesh_shape(self.config, comm, pipeline_parallel_size,
                                   tensor_parallel_size, data_parallel_size)
        self.pp_size, self.dp_size, self.tp_size = shape.pp, shape.dp, shape.tp
        if balance not in BALANCES:
            raise ValueError(f"balance={balance!r} is not one of {BALANCES}")
        self.hook.check(self.level, shape.pp, shape.tp)
        global_units = units_of(module)
        self._check(global_units)
        #: (start, stop) of every virtual stage's units (pp * virtual_stages of them)
        self.bounds, stage_names = cut_virtual_stages(
            global_units, self.pp_size, self.config.virtual_stages, balance)
        self.balance = balance
        self.shard_size = self.hook.shard_group(self.dp_size)
        # -- communicators (collective from here on) ------------------------------------------
        self._owned_comms: list[Any] = []
        self._make_mesh(world(comm) if self.config.mesh is None else comm)
        self.shard_rank = self.dp_rank % self.shard_size
        self.shard_comm = self.comm
        if self.shard_size != self.dp_size:
            self.shard_comm = self.comm.Split(self.dp_rank // self.shard_size, self.shard_rank)
            self._owned_comms.append(self.shard_comm)
        # -- this rank's units --------------------------------------------------------------------
        self.local_module = module
        partitions: dict[str, Any] = {}
        if self.tp_size > 1:
            from mpidist.nn.tensor_parallel import parallelize, tp_partitions

            self.local_module = parallelize(module, self.tp_styles, comm=self.tp_comm)
            names = set(stage_names[self.stage])
            partitions = {n: v for n, v in tp_partitions(self.local_module).items()
                          if n in names}
        every = units_of(self.local_module)
        v = self.config.virtual_stages
        spans = [self.bounds[c * self.pp_size + self.stage] for c in range(v)]
        self.units = [u for a, b in spans for u in every[a:b]]
        #: (start, stop) of each chunk among self.units
        self.chunks = chunk_spans(self.bounds, self.pp_size, self.stage, v)
        self.placement = Placement(
            [u.named_parameter_shapes() for u in self.units],
            global_units=[u.named_parameter_shapes() for u in global_units],
            stage_names=stage_names, stage=self.stage, partitions=partitions,
            tp_rank=self.tp_rank, level=self.level, **self._layout_group())
        self.layout = self.placement.layout
        self._users = tensor_users(self.units)
        self.memory: dict[str, int] = {"parameters": 0, "gradients": 0, "working_peak": 0}
        self._working = 0
        self._sync_enabled = True
        self._loss_cache: tuple[Any, Any] | None = None
        self.last_pipeline_stats: Any = None
        self._recompute = self.config.recompute == "blocks"
        self._kept: dict[tuple[int, Any], Any] = {}
        self._allocate()
        if initialize:
            self._initialize()
        self.sync_compute_parameters()
        self._bind()
        self._norm_mask = self.device.asarray(self.placement.norm_mask(self.dtype)) \
            if self._is_3d else None
        self.hook.bind(self, self.pieces)

    # -- construction -------------------------------------------------------------------------
    def _check(self, global_units: list[Any]) -> None:
        """Pure checks of the model against the mesh, level and hook."""
        check_placement(self.config, tp_size=self.tp_size, hook=self.hook)
        names = [n for u in global_units for n, _ in u.named_parameter_shapes()]
        if len(set(names)) != len(names):
            raise ValueError("a parameter is registered in two units")
        whole = [n for n, _ in self.module.named_parameter_shapes()]
        if sorted(whole) != sorted(names):
            raise ValueError(f"parameters outside every unit: {sorted(set(whole) - set(names))}")
        if self.tp_size > 1:
            self.tp_styles = tensor_parallel_styles(self.module, self.tp_plan, self.tp_size)
        tied = sorted(n for n, us in tensor_users(global_units).items() if len(us) > 1)
        if tied and self.pp_size > 1:
            raise ValueError(
                f"pipeline_parallel_size={self.pp_size} with weights shared between units "
                f"(tie_weights) is not supported: {tied}; use untied weights or pp=1"
            )
        if tied and self.level >= 2:
            raise ValueError(
                f"ZeRO-{self.level} shards parameters unit by unit and does not support "
                f"parameters shared between units (tied weights): {tied}"
            )
        if self.config.recompute != "none":
            from mpidist.nn.layers import Dropout

            drops = [n for n, m in self.module.named_modules()
                     if isinstance(m, Dropout) and m.p > 0]
            if drops:
                raise ValueError(
                    f"recompute={self.config.recompute!r} with dropout ({drops[0]}, p > 0) is "
                    "not supported: masks are drawn in sequence, so a recomputed forward "
                    "would draw different ones"
                )
        if self.level == 3 and not has_units(self.module):
            raise ValueError(
                f"ZeRO-3 needs a model made of units (a .units list of 2 or more); "
                f"{type(self.module).__name__} has none"
            )

    def _make_mesh(self, comm: Any) -> None:
        from mpidist.core.mesh import ProcessMesh

        self._owns_mesh = self.config.mesh is None
        self.mesh = self.config.mesh if self.config.mesh is not None else ProcessMesh(
            comm, pp=self.pp_size, tp=self.tp_size, dp=self.dp_size)
        self.device = arrays.device(self.config.device, comm=self.mesh.comm)
        self.xp = self.device.xp  # and the layers' 16-bit dtype under mixed precision:
        self.compute_dtype = compute_dtype(self.config.precision, self.xp)
        self.comm = self.mesh.group("dp")
        self.tp_comm = self.mesh.group("tp")
        self.pp_comm = self.mesh.group("pp")
        self.loss_comm = self.mesh.group(("pp", "dp"))
        self.dp_rank = self.mesh.coords["dp"]
        self.tp_rank = self.mesh.coords["tp"]
        self.stage = self.mesh.coords["pp"]
        self.dtype = self.config.np_dtype

    def _layout_group(self) -> dict[str, int]:
        """The group the stage's layout is padded and split over: the shard group; at level
        0 (nothing sharded) the whole dp group, whose ranks share the writing of
        checkpoints (and whose padding the flat buffers have always had)."""
        if self.level == 0:
            return {"n": self.dp_size, "rank": self.dp_rank}
        return {"n": self.shard_size, "rank": self.shard_rank}

    @property
    def replica(self) -> int:
        """This rank's replica: which group of ``shard_size`` dp ranks it belongs to."""
        return self.dp_rank // self.shard_size

    @property
    def _is_3d(self) -> bool:
        return self.pp_size > 1 or self.tp_size > 1

    def _allocate(self) -> None:
        lay, dt = self.layout, self.dtype
        if self.level < 3:
            self.params = self.xp.zeros(lay.full_size, dtype=dt)
        else:
            self.param_shard = self.xp.zeros(lay.local_size, dtype=dt)
        self.memory["parameters"] = self.parameter_storage.nbytes
        # Mixed precision: the layers run with a 16-bit copy of the master weights above.
        self._compute: Any = self.parameter_storage
        if self.compute_dtype is not None:
            self._compute = self.xp.empty(self.parameter_storage.size, dtype=self.compute_dtype)
            self.memory["parameters"] += self._compute.nbytes
        if self.level < 2:
            self.grads = self.xp.zeros(lay.full_size, dtype=dt)
            self.memory["gradients"] = self.grads.nbytes
            self.buckets = lay.buckets(self.config.bucket_bytes, dt.itemsize)
            # A bucket is final once the lowest-indexed unit using any of its tensors has run
            # backward (backward visits units from last to first).
            final_after = {name: min(us) for name, us in self._users.items()}
            self._bucket_unit = [min((final_after[n] for n in b.names), default=0)
                                 for b in self.buckets]
            self.pieces = self.buckets
            self._pending: dict[int, Any] = {}
        else:
            self.grad_shard = self.xp.zeros(lay.local_size, dtype=dt)
            self.memory["gradients"] = self.grad_shard.nbytes
            self.pieces = [Bucket(s.index, s.full_offset, s.full_offset + s.padded, s.names)
                           for s in lay.units]
            self._rs_pending: list[tuple[Any, np.ndarray, int]] = []

    def _init_unit(self, u: int) -> np.ndarray:
        """The unit's full padded initial values (made on every rank, identically)."""
        buf = self.xp.zeros(self.layout.units[u].padded, dtype=self.dtype)
        unit = self.units[u]
        unit.bind(self.layout.unit_views(u, buf), None)
        unit.init_parameters(self.seed)
        unit.unbind()
        return buf

    def _initialize(self) -> None:
        """Write the deterministic initial values into this rank's storage."""
        if self.level <= 1:
            views = self.layout.full_views(self.params)
            if self._is_3d:
                # Unit by unit through the stage's full views, so a unit reading a tied
                # weight owned by another unit can be bound.
                for unit in self.units:
                    unit.bind(views, None)
                    unit.init_parameters(self.seed)
                    unit.unbind()
            else:  # through the whole module: tied weights are visible to every unit
                self.module.bind(views, None)
                self.module.init_parameters(self.seed)
                self.module.unbind()
        elif self.level == 2:
            for u in range(len(self.units)):
                self.layout.unit_full(u, self.params)[:] = self._init_unit(u)
        else:
            r, lay = self.shard_rank, self.layout
            for u, span in enumerate(lay.units):
                lay.unit_local(u, self.param_shard)[:] = \
                    self._init_unit(u)[r * span.shard:(r + 1) * span.shard]
            return
        # Replicas must start identical even if initialisation differed (it should not).
        C.broadcast(self.params, 0, comm=self.comm)

    def _bind(self) -> None:
        """Bind the units to the storage that stays bound (none at level 3)."""
        if self.level == 3:
            return
        pviews = self.layout.full_views(self._compute)
        gviews = self.layout.full_views(self.grads) if self.level < 2 else None
        for unit in self.units:
            unit.bind(pviews, gviews)

    def _track(self, nbytes: int) -> None:
        self._working += nbytes
        self.memory["working_peak"] = max(self.memory["working_peak"], self._working)

    def _untrack(self, nbytes: int) -> None:
        self._working -= nbytes

    # -- what the level shards ------------------------------------------------------------------
    @property
    def shards_state(self) -> bool:
        """Whether the optimizer state covers only this rank's shard."""
        return self.placement.shards_state

    @property
    def shards_params(self) -> bool:
        """Whether the parameters are stored as this rank's shard only (ZeRO-3)."""
        return self.placement.shards_params

    @property
    def state_size(self) -> int:
        """Length of the optimizer-state arrays on this rank."""
        return self.placement.state_size

    @property
    def parameter_storage(self) -> np.ndarray:
        """The flat array holding this rank's parameters (full layout, or local shard)."""
        return self.param_shard if self.level == 3 else self.params

    # -- freeing ------------------------------------------------------------------------------
    def free(self) -> None:
        """Free the communicators this model created. Collective over the mesh."""
        self.hook.free()
        for c in self._owned_comms:
            c.Free()
        self._owned_comms = []
        if self._owns_mesh:
            self.mesh.free()
            self._owns_mesh = False

    def __repr__(self) -> str:
        v = len(self.chunks)
        spans = "+".join(f"[{a}:{b}]" for a, b in (self.bounds[c * self.pp_size + self.stage]
                                                     for c in range(v)))
        return (f"{type(self).__name__}({type(self.module).__name__}, level={self.level}, "
                f"hook={self.hook.name}, stage={self.stage} units{spans}, pp={self.pp_size}, "
                f"dp={self.dp_size}, tp={self.tp_size}, dtype={self.dtype})")
