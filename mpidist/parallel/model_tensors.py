"""The update, the pipeline's loss and whole tensors of a sharded model.

:class:`ModelTensors` is part of :class:`~mpidist.parallel.model.ShardedModel`: the flat
pieces the optimizer updates and the allgather after it, the global gradient norm, the
loss the last stage runs under tensor parallelism, and this rank's storage as whole named
global tensors and back (state dicts, checkpoints, serialisation), answered by the
model's :class:`~mpidist.parallel.placement.Placement`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpidist.core import collectives as C
from mpidist.parallel.tensor import check_loss, vocab_sharded

__all__ = ["ModelTensors"]


class ModelTensors:
    """The update, loss and whole-tensor half of
    :class:`~mpidist.parallel.model.ShardedModel` (see the module docstring)."""

    # (provided by ShardedModel)
    level: int
    layout: Any
    placement: Any
    dtype: np.dtype
    xp: Any
    device: Any
    mesh: Any
    module: Any
    local_module: Any
    params: np.ndarray
    grads: np.ndarray
    param_shard: np.ndarray
    grad_shard: np.ndarray
    parameter_storage: np.ndarray
    shard_comm: Any
    tp_comm: Any
    pp_comm: Any
    tp_size: int
    tp_styles: dict[str, Any]
    replica: int
    shards_state: bool
    memory: dict[str, int]
    _is_3d: bool
    _norm_mask: Any
    _loss_cache: tuple[Any, Any] | None
    sync_compute_parameters: Any

    # -- the update ---------------------------------------------------------------------------
    def update_pieces(self) -> list[tuple[np.ndarray, np.ndarray, slice]]:
        """``(param, grad, state_slice)`` flat pieces the optimizer updates on this rank."""
        lay = self.layout
        if self.level == 0:
            return [(self.params, self.grads, slice(0, lay.full_size))]
        if self.level == 3:
            return [(self.param_shard, self.grad_shard, slice(0, lay.local_size))]
        out = []
        for u, span in enumerate(lay.units):
            p = lay.unit_shard_of_full(u, self.params)
            g = lay.unit_shard_of_full(u, self.grads) if self.level == 1 \
                else lay.unit_local(u, self.grad_shard)
            out.append((p, g, slice(span.local_offset, span.local_offset + span.shard)))
        return out

    def after_update(self) -> None:
        """Allgather every unit's updated shards (levels 1-2). Collective over the shard
        group."""
        if self.level in (1, 2):
            self.placement.allgather_units(self.params, comm=self.shard_comm)

    def _local_grad(self, u: int) -> np.ndarray:
        """This rank's shard of unit u's synchronised gradients."""
        if self.level >= 2:
            return self.layout.unit_local(u, self.grad_shard)
        return self.layout.unit_shard_of_full(u, self.grads)

    def grad_sq_norm(self) -> float:
        """Squared global L2 norm of the synchronised gradients: a tp-split tensor counts
        each slice once, a tp-replicated one once, each dp shard once, summed over the
        stages. Collective over the mesh (3D), the shard group (levels 2-3), or not."""
        if self._is_3d:
            total = 0.0
            for u in range(len(self.layout.units)):
                g = self._local_grad(u)
                w = self.layout.unit_local(u, self._norm_mask)
                total += float(self.xp.dot(g * w, g))
            buf = np.array([total])
            C.allreduce(buf, "sum", comm=self.mesh.comm)
            return float(buf[0])
        if self.level < 2:  # synchronised gradients are whole on every rank
            return float(self.xp.dot(self.grads, self.grads))
        total_ = np.array([float(self.xp.dot(self.grad_shard, self.grad_shard))])
        C.allreduce(total_, "sum", comm=self.shard_comm)
        return float(total_[0])

    # -- the pipeline's loss ------------------------------------------------------------------
    def stage_loss(self, loss: Any) -> Any:
        """The loss the last stage runs: when tensor parallelism shards the output over the
        vocabulary, a :class:`CrossEntropyLoss` becomes the vocab-parallel cross-entropy
        over tp (same value, vocabulary-sharded logits)."""
        if self.tp_size == 1 or not vocab_sharded(self.module, self.tp_styles):
            return loss
        check_loss(loss, self.tp_size)
        if self._loss_cache is None or self._loss_cache[0] is not loss:
            self._loss_cache = (loss, self.local_module.loss())
        return self._loss_cache[1]

    # -- whole tensors (state dicts, checkpoints, serialisation) ------------------------------
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the whole model with its global shape. Pure."""
        return dict(self.placement.global_shapes)

    @property
    def global_layout(self) -> Any:
        """The single-process layout of the whole model (what serialised bytes describe)."""
        return self.placement.global_layout

    def gather_state(self, local: np.ndarray) -> np.ndarray:
        """A state array in the stage's full layout from this rank's. Collective over the
        shard group when the state is sharded."""
        return self.placement.gather(local, comm=self.shard_comm, sharded=self.shards_state)

    def scatter_state(self, full: np.ndarray, local: np.ndarray) -> None:
        """Copy this rank's part of a full-layout state array into ``local``. Not collective."""
        self.placement.scatter(full, local, sharded=self.shards_state)

    def _global(self, full: np.ndarray) -> dict[str, np.ndarray]:
        return self.placement.global_tensors(full, tp_comm=self.tp_comm, pp_comm=self.pp_comm)

    def full_parameters(self) -> dict[str, np.ndarray]:
        """Every parameter as a global array (copies). Collective over the mesh."""
        full = self.params if self.level < 3 else self.placement.gather(
            self.param_shard, comm=self.shard_comm)
        return self._global(full)

    def load_full_parameters(self, params: dict[str, np.ndarray]) -> None:
        """Take this rank's part of global parameter arrays. Not collective."""
        full = self.placement.local_full(params, self.dtype)
        if self.level < 3:
            self.params[...] = self.device.asarray(full)
        else:
            self.placement.scatter(full, self.param_shard)
        self.sync_compute_parameters()

    def state_tensors(self, local: np.ndarray) -> dict[str, np.ndarray]:
        """A state array of this rank as whole named global tensors. Collective."""
        return self._global(self.gather_state(local))

    def load_state_tensors(self, tensors: dict[str, np.ndarray], local: np.ndarray) -> None:
        """Fill this rank's state array from whole named tensors. Not collective."""
        self.scatter_state(self.placement.local_full(tensors, local.dtype), local)

    def checkpoint_pieces(self, state_buffers: dict[str, np.ndarray], *, for_writing: bool
                          ) -> list[tuple[str, slice, np.ndarray]]:
        """This rank's pieces of every checkpoint tensor (see
        :meth:`Placement.checkpoint_pieces`; with several sharded replicas, replica 0
        writes them). Not collective."""
        if for_writing and self.level > 0 and self.replica > 0:
            return []
        return self.placement.checkpoint_pieces(self.parameter_storage, state_buffers,
                                                for_writing=for_writing)

    def memory_report(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients, and the peak working set."""
        return dict(self.memory)
