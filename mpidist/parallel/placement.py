"""The placement: which rank holds which slice of which tensor, with what padding.

One :class:`Placement` describes a model on a (pp, dp, tp) mesh at a sharding level:

* **pp** — the model's units are cut into consecutive stages (``bounds``); a rank holds the
  units of its stage (``stage_names``);
* **tp** — a tensor-parallel tensor is split along one axis (``partitions``: name ->
  (:class:`~mpidist.nn.tensor_parallel.TPPartition`, global shape)); the others are whole
  on every tp rank;
* **dp** — the stage's tensors are packed unit by unit into one flat buffer, each unit
  padded to a multiple of the shard group's size (``layout``, a
  :class:`~mpidist.core.buffers.ShardedLayout`); at level >= 1 a rank keeps only its shard of
  every unit's optimizer state, at level >= 2 of its gradients, at level 3 of its
  parameters.

Everything a strategy, a checkpoint, elastic resharding or serialisation needs to know
about slices and padding is asked here: the pure arithmetic (``local_full``,
``tensor_pieces``, ``checkpoint_pieces``, ``scatter``, ``norm_mask``) and the collectives
that assemble whole tensors (``gather``, ``global_tensors``), which take their
communicators as arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpidist.core import collectives as C
from mpidist.core.arrays import as_like, namespace, to_host
from mpidist.core.buffers import ShardedLayout

__all__ = ["LEVELS", "LEVEL_NAMES", "Placement"]

#: sharding levels: what is sharded over the data-parallel (shard) group
LEVELS = {0: "nothing", 1: "optimizer state", 2: "optimizer state and gradients",
          3: "optimizer state, gradients and parameters"}
#: the strategy name of each level with synchronous gradients (the reference system's)
LEVEL_NAMES = ("ddp", "zero1", "zero2", "zero3")


class Placement:
    """Where every element of a model lives on a (pp, dp, tp) mesh at a sharding level.

    Pure: construction and the arithmetic methods do not communicate; the methods that
    do (``gather``, ``global_tensors``) say so.

    Args:
        stage_units: this rank's units (its pipeline stage, in their tensor-parallel form),
            each as ``(name, local shape)`` pairs.
        global_units: every unit of the whole (single-process) model, as ``(name, shape)``
            pairs.
        stage_names: for every pipeline stage, the names of its tensors.
        stage: this rank's pipeline stage.
        partitions: ``{name: (partition, global shape)}`` of this rank's tp-split tensors.
        tp_rank: this rank's index in the tensor-parallel group.
        level: 0-3 (see :data:`LEVELS`).
        n, rank: the size of the group the stage is sharded over and this rank's index.
    """

    def __init__(self, stage_units: Sequence[Sequence[tuple[str, Sequence[int]]]], *,
                 global_units: Sequence[Sequence[tuple[str, Sequence[int]]]],
                 stage_names: list[list[str]],
                 stage: int = 0, partitions: dict[str, Any] | None = None, tp_rank: int = 0,
                 level: int = 0, n: int = 1, rank: int = 0) -> None:
        if level not in LEVELS:
            raise ValueError(f"level={level!r} must be one of {sorted(LEVELS)}")
        self.level = int(level)
        self.layout = ShardedLayout(stage_units, n, rank)
        #: every tensor of the model with its single-process shape, in unit order
        self.global_shapes = {n: tuple(int(d) for d in shape) for u in global_units
                              for n, shape in u}
        self.stage_names = stage_names
        self.stage = stage
        self.partitions = dict(partitions or {})
        self.tp_rank = tp_rank
        # The single-process layout of the whole model (what serialised bytes describe).
        self.global_layout = ShardedLayout(global_units, 1, 0)

    # -- what the level shards ------------------------------------------------------------
    @property
    def shards_state(self) -> bool:
        return self.level >= 1

    @property
    def shards_grads(self) -> bool:
        return self.level >= 2

    @property
    def shards_params(self) -> bool:
        return self.level >= 3

    @property
    def state_size(self) -> int:
        """Length of this rank's optimizer-state arrays."""
        return self.layout.local_size if self.shards_state else self.layout.full_size

    # -- one group's shards ---------------------------------------------------------------
    def shard_pieces(self, full: np.ndarray, local: np.ndarray
                     ) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(this rank's shard of unit u in full, unit u's piece of local)`` per unit."""
        lay = self.layout
        return [(lay.unit_shard_of_full(u, full), lay.unit_local(u, local))
                for u in range(len(lay.units))]

    def gather(self, local: np.ndarray, *, comm: Any, sharded: bool = True) -> np.ndarray:
        """A full-layout array from this rank's shards (``sharded``) or itself. Collective
        over ``comm`` (the shard group) when sharded."""
        if not sharded:
            return local
        full = namespace(local).zeros(self.layout.full_size, dtype=local.dtype)
        reqs = []
        for u, (mine, piece) in enumerate(self.shard_pieces(full, local)):
            mine[:] = piece
            reqs.append(C.iallgather_inplace(self.layout.unit_full(u, full), comm=comm))
        C.wait_all(reqs)
        return full

    def scatter(self, full: np.ndarray, local: np.ndarray, *, sharded: bool = True) -> None:
        """Copy this rank's part of a full-layout array into ``local``. Not collective."""
        full = as_like(local, full)
        if not sharded:
            local[:] = full
            return
        for mine, piece in self.shard_pieces(full, local):
            piece[:] = mine

    def allgather_units(self, full: np.ndarray, *, comm: Any) -> None:
        """Allgather every unit's shard in place in a full-layout array. Collective over
        ``comm``."""
        if self.layout.n == 1:
            return
        C.wait_all([C.iallgather_inplace(self.layout.unit_full(u, full), comm=comm)
                    for u in range(len(self.layout.units))])

    # -- named tensors ------------------------------------------------------------------------
    def tensor_pieces(self, array: np.ndarray, *, sharded: bool, owned: bool
                      ) -> list[tuple[str, slice, np.ndarray]]:
        """``(name, flat slice of the stage tensor, 1-D view of array)`` per tensor.

        ``array`` is a local-shard array (``sharded``) or a full-layout one. With ``owned``
        a full-layout array yields only this rank's share (its shard of each unit), so the
        group's ranks together cover every element once (for writing); without it, every
        element (for reading into replicated storage). Not collective.
        """
        lay = self.layout
        if sharded:
            return [(n, ts, array[ls]) for n, ts, ls in lay.local_pieces()]
        if owned:
            out = []
            for name, ts, ls in lay.local_pieces():
                span = lay.units[lay.unit_of(name)]
                start = span.full_offset + lay.rank * span.shard + ls.start - span.local_offset
                out.append((name, ts, array[start:start + (ls.stop - ls.start)]))
            return out
        return [(n, slice(0, s.size), array[s.offset:s.stop])
                for n in lay.names for s in (lay.spec(n),)]

    def checkpoint_pieces(self, params: np.ndarray, state: dict[str, np.ndarray], *,
                          for_writing: bool, params_sharded: bool | None = None,
                          state_sharded: bool | None = None
                          ) -> list[tuple[str, slice, np.ndarray]]:
        """``(checkpoint name, flat slice of the global tensor, 1-D data)`` of this rank.

        For writing, every element of every global tensor is owned by exactly one rank of
        the mesh: its pipeline stage, then tp rank 0 for tp-replicated tensors (each tp rank
        for its own slice of a split tensor), then the dp shard. For reading, each rank asks
        for everything its storage holds. A tp slice that is not contiguous in the global
        tensor (a column block) becomes one piece per contiguous run. ``params_sharded`` /
        ``state_sharded``: whether ``params`` / ``state`` are local shards (default: as the
        level stores them; in-job recovery's snapshots keep shards at levels 1-2 too). Not
        collective.
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

        add("params/", params, self.shards_params if params_sharded is None else params_sharded)
        for key, buf in state.items():
            add(f"optimizer/{key}/", buf,
                self.shards_state if state_sharded is None else state_sharded)
        return out

    def local_full(self, tensors: dict[str, np.ndarray], dtype: Any) -> np.ndarray:
        """This stage's full-layout array holding this rank's slices of global tensors.
        Not collective."""
        full = np.zeros(self.layout.full_size, dtype=dtype)
        views = self.layout.full_views(full)
        for n in self.stage_names[self.stage]:
            src = np.asarray(tensors[n])
            entry = self.partitions.get(n)
            views[n][...] = src if entry is None else entry[0].take(src)
        return full

    def global_tensors(self, full: np.ndarray, *, tp_comm: Any, pp_comm: Any
                       ) -> dict[str, np.ndarray]:
        """Every tensor of the model, global and unsharded, from this stage's full-layout
        array. Collective over tp (one allgather of the split tensors) and pp (one
        broadcast per stage); the same dict on every rank (NumPy arrays)."""
        views = self.layout.full_views(to_host(full))
        names = self.stage_names[self.stage]
        out: dict[str, np.ndarray] = {n: np.array(views[n]) for n in names
                                      if n not in self.partitions}
        split = [n for n in names if n in self.partitions]
        if split:
            flat = np.concatenate([views[n].reshape(-1) for n in split])
            tp = tp_comm.Get_size()
            every = C.allgather(flat, comm=tp_comm).reshape(tp, -1)
            for n in split:
                out[n] = np.empty(self.global_shapes[n], dtype=full.dtype)
            for r in range(tp):
                off = 0
                for n in split:
                    part, gshape = self.partitions[n]
                    k = views[n].size
                    out[n][part.for_rank(r).index(gshape)] = \
                        every[r, off:off + k].reshape(views[n].shape)
                    off += k
        if len(self.stage_names) > 1:
            for s, stage_names in enumerate(self.stage_names):
                sizes = [int(np.prod(self.global_shapes[n])) for n in stage_names]
                if s == self.stage:
                    buf = np.concatenate([out[n].reshape(-1) for n in stage_names])
                else:
                    buf = np.empty(sum(sizes), dtype=full.dtype)
                C.broadcast(buf, s, comm=pp_comm)
                off = 0
                for n, k in zip(stage_names, sizes, strict=True):
                    out[n] = buf[off:off + k].reshape(self.global_shapes[n])
                    off += k
        return {n: out[n] for n in self.global_shapes}

    def norm_mask(self, dtype: Any) -> np.ndarray:
        """1 where this rank's local shard counts towards the global gradient norm: split
        tensors on every tp rank, tp-replicated ones on tp rank 0 only. Pure."""
        mask = np.zeros(self.layout.local_size, dtype=dtype)
        for name, _, in_local in self.layout.local_pieces():
            if name in self.partitions or self.tp_rank == 0:
                mask[in_local] = 1
        return mask

    def unit_offset(self, u: int, a: int, *, sharded: bool) -> int:
        """Where element ``a`` of unit ``u``'s packed tensors sits in this rank's storage
        (its local shard when ``sharded``, the full layout otherwise); a sharded element
        must lie in this rank's shard. Pure."""
        span = self.layout.units[u]
        if not sharded:
            return span.full_offset + a
        return span.local_offset + a - self.layout.rank * span.shard

    def __repr__(self) -> str:
        return (f"Placement(stage={self.stage}/{len(self.stage_names)}, level={self.level}, "
                f"{self.layout!r}, tp-split={len(self.partitions)})")
