"""What Local SGD, gradient compression and async SGD share: a DDP model whose
strategy-specific exchanges go through a :class:`~mpidist.parallel.exchange.CountingComm`,
and an optimizer base with the measured ``bytes_sent`` counters.

Loss convention (see :mod:`mpidist.parallel.engine`): each rank normalises its local loss
by the global number of samples, so summing gradients over the dp group gives the global
mean gradient, and a rank's own gradient times (global count / local count) is its
local-mean gradient. The base step's control messages (the batch-size table, 16 bytes per
rank, and the 8-byte loss allreduce) do not go through the meter and are not counted.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from mpidist.parallel.ddp import DDPModel
from mpidist.parallel.engine import ShardedOptimizer
from mpidist.parallel.exchange import CountingComm, RequestChain

__all__ = ["MeteredModel", "MeteredOptimizer", "check_int"]


class MeteredModel(DDPModel):
    """A DDP model whose strategy-specific exchanges go through a :class:`CountingComm`."""

    #: whether the strategy needs a second communicator for second-phase exchanges
    two_phase = False

    def _allocate(self) -> None:
        super()._allocate()
        self.meter = CountingComm(self.comm)
        self.meter2: CountingComm | None = None
        if self.two_phase and self.dp_size > 1:
            self.meter2 = CountingComm(self.comm.Dup(), totals=self.meter)
        self._gate: deque[RequestChain] = deque()
        self.dense_bytes = 0  # bytes of the uncompressed buffers handed to the exchange

    def free(self) -> None:
        """Free the communicators this wrapper created. Collective over the mesh."""
        if self.meter2 is not None:
            self.meter2.comm.Free()
            self.meter2 = None
        super().free()


class MeteredOptimizer(ShardedOptimizer):
    """Adds the measured ``bytes_sent`` counters to a strategy optimizer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bytes_sent_last_step = 0
        self._bytes_before = 0
        self._loading: dict[str, Any] | None = None
        self._incoming: np.ndarray | None = None

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has passed to MPI for gradient/parameter exchange since wrap."""
        model = self.model
        return 0 if model is None else int(model.meter.bytes)

    @property
    def bytes_sent_per_step(self) -> float:
        """Mean bytes sent per step since wrap (:attr:`bytes_sent` / steps)."""
        return self.bytes_sent / self.step_count if self.step_count else 0.0

    def step(self, model: Any, batch: tuple[Any, Any]) -> float:
        model = self._resolve(model)
        before = model.meter.bytes
        loss = self._step(model, batch)
        self.bytes_sent_last_step = int(model.meter.bytes - before)
        return loss

    def _step(self, model: Any, batch: tuple[Any, Any]) -> float:
        return super().step(model, batch)

    def memory_report(self) -> dict[str, int]:
        out = super().memory_report()
        extra = self._extra_memory()
        out.update(extra)
        out["total"] += sum(extra.values())
        return out

    def _extra_memory(self) -> dict[str, int]:
        return {}

    # -- strategy state in checkpoints (see mpidist.checkpoint.training) --------------------
    #: name of this strategy's per-rank state in checkpoints: ``strategy/<state_kind>``
    state_kind = "none"

    def rank_state_arrays(self) -> list[np.ndarray]:
        """This rank's own strategy state (not shared with other ranks), in a fixed order."""
        return []

    def strategy_state_attrs(self) -> dict[str, Any]:
        """What the checkpoint records about the strategy state (JSON). Not collective."""
        arrays = self.rank_state_arrays()
        if not arrays:
            return {}
        model = self._require_model()
        return {"kind": self.state_kind, "dp": model.dp_size,
                "numel": int(sum(a.size for a in arrays))}

    def strategy_state_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The global tensors of the strategy state: one row per dp rank."""
        attrs = self._loading if self._loading is not None else self.strategy_state_attrs()
        if not attrs:
            return {}
        model = self._require_model()
        return {f"strategy/{self.state_kind}": ((attrs["dp"], attrs["numel"]),
                                                np.dtype(model.dtype).name)}

    def strategy_state_pieces(self, *, for_writing: bool) -> list[tuple[str, slice, np.ndarray]]:
        """This rank's row: its state to write, or the buffer it is read into."""
        if for_writing:
            arrays = self.rank_state_arrays()
            data = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else None
        else:
            data = self._incoming
        if data is None:
            return []
        r, n = self._require_model().dp_rank, data.size
        return [(f"strategy/{self.state_kind}", slice(r * n, (r + 1) * n), data)]

    def prepare_strategy_state(self, attrs: dict[str, Any] | None) -> bool:
        """Before loading: check the checkpoint's strategy state ``attrs`` against this run
        and make the buffers it is read into. Returns whether to read it (False when the
        checkpoint has none of this kind: the state then starts fresh). Not collective;
        raises the same ValueError on every rank when the state cannot be resumed here."""
        self._loading, self._incoming = None, None
        mine = self.strategy_state_attrs()
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
        self._incoming = np.empty(attrs["numel"], dtype=self._require_model().dtype)
        return True

    def finish_strategy_state(self) -> None:
        """After loading: move the state read into place. Not collective."""
        data, self._incoming, self._loading = self._incoming, None, None
        if data is None:
            return
        pos = 0
        for a in self.rank_state_arrays():
            a.reshape(-1)[:] = data[pos:pos + a.size]
            pos += a.size


def check_int(owner: str, name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{owner}: {name}={value!r} must be an integer >= {low}")
    return int(value)


