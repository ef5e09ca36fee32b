"""Local SGD (periodic model averaging): every rank takes ``sync_every`` local steps on its
own gradient, then the replicas are averaged with one allreduce of the flat parameter
buffer (optionally with the optimizer state in the same message)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from mpidist import collectives as C
from mpidist.parallel.metered import MeteredModel, MeteredOptimizer, check_int

__all__ = ["LocalSGDModel", "LocalSGDOptimizer"]


class LocalSGDModel(MeteredModel):
    """Replicas that train on their own gradients; backward never synchronises."""

    strategy = "local_sgd"

    def backward(self, dy: Any, ctx: Any = None) -> Any:
        """Backward into the local gradients; returns the input gradient. Not collective."""
        for u in range(len(self.units) - 1, -1, -1):
            dy = self.units[u].backward(dy, ctx)
        return dy

    def sync_gradients(self) -> None:
        """Local SGD does not synchronise gradients."""

    def finish_gradient_sync(self) -> None:
        """Nothing to wait for."""

    def grad_sq_norm(self) -> float:
        return float(np.dot(self.grads, self.grads))


class LocalSGDOptimizer(MeteredOptimizer):
    """Local SGD (a.k.a. periodic model averaging, Stich 2019; Lin et al. 2020).

    Each rank updates its replica with its own local-mean gradient (the rank's gradient,
    normalised by the global batch, times the global over the local batch size, folded into
    the kernel's ``grad_scale``) for ``sync_every`` steps; then the replicas are averaged,
    each weighted by its share of the global batch (equal weights when the batch divides
    into the ranks), with one allreduce of the flat parameter buffer, and with
    ``average_optimizer_state`` the optimizer state (momentum, Adam moments) travels in the
    same message. With ``sync_every=1`` and SGD without momentum this is DDP up to rounding,
    at any world size.

    ``step`` is collective over dp: it checks the batch sizes, returns the global loss
    (one 8-byte allreduce; ``sync_loss=False`` returns this replica's local-mean loss
    instead, with no per-step communication at all), and averages on every
    ``sync_every``-th step. Clipping (``config.max_grad_norm``) clips each rank's local-mean
    gradient by its own norm.
    """

    model_class = LocalSGDModel

    def __init__(self, base: Any, config: Any = None, *, sync_every: int = 8,
                 average_optimizer_state: bool = False, sync_loss: bool = True,
                 loss: Any = None, lr_schedule: Any = None) -> None:
        self.sync_every = check_int("LocalSGDOptimizer", "sync_every", sync_every, 1)
        for name, v in (("average_optimizer_state", average_optimizer_state),
                        ("sync_loss", sync_loss)):
            if not isinstance(v, bool):
                raise ValueError(f"LocalSGDOptimizer: {name}={v!r} must be True or False")
        self.average_optimizer_state = average_optimizer_state
        self.sync_loss = sync_loss
        super().__init__(base, config, loss=loss, lr_schedule=lr_schedule)
        self.averages = 0

    def _step(self, model: Any, batch: tuple[Any, Any]) -> float:
        x, y = batch
        t0 = time.perf_counter()
        local_loss = self._forward_backward(model, x, y, sync=False)
        t1 = time.perf_counter()
        # The gradient is normalised by the global batch; the replica steps on its own
        # batch's mean (the ranks' batches may differ in size).
        local, total = self.batch_share
        share = total / local
        scale = share
        if self.config.max_grad_norm is not None:
            norm = share * float(np.sqrt(model.grad_sq_norm()))
            scale *= min(1.0, self.config.max_grad_norm / (norm + 1e-6))
        self._apply_update(scale)
        self.step_count += 1
        t2 = time.perf_counter()
        if self.step_count % self.sync_every == 0:
            self.average_replicas()
        loss = self._global_loss(model, local_loss) if self.sync_loss else local_loss * share
        t3 = time.perf_counter()
        self.timers["compute"] += t1 - t0
        self.timers["update"] += t2 - t1
        self.timers["communication"] += t3 - t2
        return loss

    def average_replicas(self) -> None:
        """Average the parameters (and, if configured, optimizer state) over dp, each
        replica weighted by its share of the last step's global batch.

        Collective over the dp group: one allreduce of one contiguous buffer.
        """
        model = self._require_model()
        local, total = self.batch_share
        # Each replica weighs by its share of the global batch (1/n when the batch divides
        # into the ranks, or before any step), so that with sync_every=1 and plain SGD the
        # average is DDP's step also when the ranks' batches differ in size.
        weight = local / total if total else 1.0 / model.dp_size
        bufs = [model.params]
        if self.average_optimizer_state:
            bufs += [b for _, b in sorted(self.state.buffers.items())]
        if len(bufs) == 1:
            model.params *= model.dtype.type(weight)
            C.allreduce(model.params, "sum", comm=model.meter)
        else:
            packed = np.concatenate(bufs)
            packed *= packed.dtype.type(weight)
            C.allreduce(packed, "sum", comm=model.meter)
            pos = 0
            for b in bufs:
                b[:] = packed[pos:pos + b.size]
                pos += b.size
        model.dense_bytes += sum(b.nbytes for b in bufs)
        self.averages += 1

    state_kind = "local_sgd"

    def rank_state_arrays(self) -> list[np.ndarray]:
        """This replica's parameters and optimizer state: between averages they differ
        from rank to rank, so a checkpoint keeps every replica to resume exactly."""
        model = self._require_model()
        return [model.params] + [b for _, b in sorted(self.state.buffers.items())]

    def state_dict(self) -> dict[str, Any]:
        """The replica average (parameters, and state if averaged) as a state dict.

        Collective over dp. The replicas themselves are left as they were; the bytes of
        this average are not counted in :attr:`bytes_sent`.
        """
        model = self._require_model()
        saved = [model.params.copy()] + [b.copy() for _, b in sorted(self.state.buffers.items())]
        counted = (model.meter.bytes, model.meter.calls, model.dense_bytes, self.averages)
        self.average_replicas()
        try:
            return super().state_dict()
        finally:
            model.params[:] = saved[0]
            for (_, b), s in zip(sorted(self.state.buffers.items()), saved[1:], strict=True):
                b[:] = s
            model.meter.bytes, model.meter.calls, model.dense_bytes, self.averages = counted


