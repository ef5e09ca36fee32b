"""Bounded-staleness asynchronous SGD: the gradient of step t is allreduced with a
nonblocking call that may stay in flight for up to ``staleness`` steps while later steps
compute."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np

from mpidist.parallel.engine import ShardedModel
from mpidist.parallel.exchange import RequestChain, iallreduce
from mpidist.parallel.metered import MeteredModel, MeteredOptimizer, check_int

__all__ = ["AsyncSGDModel", "AsyncSGDOptimizer"]


class AsyncSGDModel(MeteredModel):
    """A DDP model whose backward does not synchronise; the optimizer exchanges copies."""

    strategy = "async_sgd"

    def backward(self, dy: Any, ctx: Any = None) -> Any:
        """Backward into the local gradients, driving pending exchanges between units;
        returns the input gradient. Not collective."""
        for u in range(len(self.units) - 1, -1, -1):
            dy = self.units[u].backward(dy, ctx)
            self.progress()
        return dy

    def progress(self) -> None:
        """Let MPI advance the in-flight gradient allreduces. Not collective."""
        for req, _ in getattr(self, "inflight", ()):
            req.test()

    def sync_gradients(self) -> None:
        """Exchanges are started by the optimizer."""

    def finish_gradient_sync(self) -> None:
        """Exchanges are completed by the optimizer."""


class AsyncSGDOptimizer(MeteredOptimizer):
    """SGD with bounded staleness: gradient allreduces overlap the next ``staleness`` steps.

    At step t the local gradient is copied into a buffer whose nonblocking allreduce is
    started at once; then, while more than ``staleness`` exchanges are in flight, the
    oldest is waited for and applied. So in steady state step t applies the summed
    gradient of step t - s; the first s steps apply nothing (the parameters stay at their
    initial values while the pipeline fills); :meth:`flush` applies every pending
    gradient. ``staleness=0`` is DDP (one allreduce of the whole buffer instead of buckets).

    Every rank applies the same summed gradients in the same order, so replicas stay
    identical. ``step`` is collective over dp. Clipping uses the norm of the applied
    (summed) gradient; the learning-rate schedule is evaluated at the applying step.
    :meth:`state_dict` flushes first (collective), so a checkpoint holds every gradient.
    """

    model_class = AsyncSGDModel

    def __init__(self, base: Any, config: Any = None, *, staleness: int = 1,
                 loss: Any = None, lr_schedule: Any = None) -> None:
        self.staleness = check_int("AsyncSGDOptimizer", "staleness", staleness, 0)
        super().__init__(base, config, loss=loss, lr_schedule=lr_schedule)
        self._pool: list[np.ndarray] = []
        self._incoming_list: list[np.ndarray] | None = None
        self.applied = 0

    def attach(self, model: ShardedModel) -> None:
        super().attach(model)
        model.inflight = deque()  # type: ignore[attr-defined]
        self._buffers_made = 0

    def _step(self, model: Any, batch: tuple[Any, Any]) -> float:
        x, y = batch
        t0 = time.perf_counter()
        local_loss = self._forward_backward(model, x, y, sync=False, progress=model.progress)
        t1 = time.perf_counter()
        buf = self._pool.pop() if self._pool else None
        if buf is None:
            buf = np.empty_like(model.grads)
            self._buffers_made += 1
        buf[:] = model.grads
        model.dense_bytes += buf.nbytes
        model.inflight.append((RequestChain(iallreduce(buf, model.meter), None), buf))
        self.step_count += 1
        t_update = 0.0
        while len(model.inflight) > self.staleness:
            t_update += self._apply_oldest(model)
        loss = self._global_loss(model, local_loss)
        t2 = time.perf_counter()
        self.timers["compute"] += t1 - t0
        self.timers["update"] += t_update
        self.timers["communication"] += t2 - t1 - t_update
        return loss

    def _apply_oldest(self, model: Any) -> float:
        req, buf = model.inflight.popleft()
        req.wait()
        t0 = time.perf_counter()
        scale = 1.0
        if self.config.max_grad_norm is not None:
            norm = float(np.sqrt(np.dot(buf, buf)))
            scale = min(1.0, self.config.max_grad_norm / (norm + 1e-6))
        st = self._pieces[0][2]
        self.base.update(model.params, buf, st, grad_scale=scale, lr=self._lr())
        self._require_state()
        self.state.step = st.step
        self._pool.append(buf)
        self.applied += 1
        return time.perf_counter() - t0

    @property
    def in_flight(self) -> int:
        """Gradient exchanges started but not yet applied."""
        return 0 if self.model is None else len(self.model.inflight)

    def flush(self) -> None:
        """Wait for and apply every in-flight gradient, oldest first. Collective over dp."""
        model = self._require_model()
        while model.inflight:
            self._apply_oldest(model)

    def state_dict(self) -> dict[str, Any]:
        """:meth:`flush`, then the state dict (collective over dp)."""
        self.flush()
        return super().state_dict()

    # -- the in-flight gradients in checkpoints --------------------------------------------
    state_kind = "async_sgd"

    def strategy_state_attrs(self) -> dict[str, Any]:
        """Completes the in-flight exchanges (without applying them, so the trajectory is
        unchanged) and records how many there are. Collective over dp."""
        model = self._require_model()
        for chain, _ in model.inflight:
            chain.wait()
        return {"kind": self.state_kind, "in_flight": len(model.inflight)}

    def strategy_state_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Each in-flight summed gradient as named global tensors (the same on every rank,
        so they resume at any world size)."""
        model = self._require_model()
        k = self._loading["in_flight"] if self._loading is not None else len(model.inflight)
        dtype = np.dtype(model.dtype).name
        return {f"strategy/async_sgd/{i}/{n}": (shape, dtype) for i in range(k)
                for n, shape in model.tensor_shapes().items()}

    def strategy_state_pieces(self, *, for_writing: bool) -> list[tuple[str, slice, np.ndarray]]:
        model = self._require_model()
        bufs = [b for _, b in model.inflight] if for_writing else (self._incoming_list or [])
        return [(f"strategy/async_sgd/{i}/{n}", sl, arr) for i, buf in enumerate(bufs)
                for n, sl, arr in model.tensor_pieces(buf, sharded=False, owned=for_writing)]

    def prepare_strategy_state(self, attrs: dict[str, Any] | None) -> bool:
        self._loading, self._incoming_list = None, None
        if not attrs or attrs.get("kind") != self.state_kind:
            return False
        model = self._require_model()
        self._loading = attrs
        self._incoming_list = [np.zeros_like(model.grads) for _ in range(attrs["in_flight"])]
        return True

    def finish_strategy_state(self) -> None:
        model = self._require_model()
        bufs, self._incoming_list, self._loading = self._incoming_list, None, None
        if bufs is not None:
            model.inflight = deque((RequestChain([], None), b) for b in bufs)

    def _extra_memory(self) -> dict[str, int]:
        model = self.model
        return {"gradient_copies": 0 if model is None
                else self._buffers_made * model.grads.nbytes}


