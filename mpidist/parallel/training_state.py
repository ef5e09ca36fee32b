"""The training state of a strategy optimizer as named full tensors: ``state_dict`` /
``load_state_dict``, self-describing bytes (``serialize`` / ``deserialize``) and HDF5
checkpoints (``save`` / ``load``). A mixin of :class:`~mpidist.parallel.engine.ShardedOptimizer`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = ["TrainingStateMixin", "check_names"]


class TrainingStateMixin:
    """State methods of :class:`~mpidist.parallel.engine.ShardedOptimizer` (which provides
    ``_require_model``, ``state``, ``base``, ``sampler``, ``step_count`` and ``strategy``)."""

    # Provided by ShardedOptimizer.
    state: Any
    base: Any
    sampler: Any
    step_count: int
    strategy: str
    pieces: list[Any]
    _data_state: dict[str, Any] | None

    def _require_model(self) -> Any:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Parameters and optimizer state as full named arrays. Collective over dp.

        ``{"strategy", "step", "optimizer": {...}, "params": {name: array},
        "state": {state_name: {name: array}}}`` — the same on every rank, and loadable by
        any strategy at any data-parallel size (:meth:`load_state_dict`).
        """
        model = self._require_model()
        params = model.full_parameters()
        state = {key: model.state_tensors(local) for key, local in self.state.buffers.items()}
        return {
            "strategy": self.strategy,
            "step": int(self.state.step),
            "steps_taken": int(self.step_count),
            "optimizer": self.base.config(),
            "params": params,
            "state": state,
            "data": None if self.sampler is None else self.sampler.state_dict(),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` of any strategy and size. Not collective.

        Raises ValueError naming missing or unexpected parameters and shape mismatches.
        """
        model = self._require_model()
        expected = model.tensor_shapes()
        check_names("parameters", expected, d.get("params", {}))
        if d.get("optimizer", {}).get("name") != self.base.name:
            raise ValueError(
                f"state dict is for optimizer {d.get('optimizer', {}).get('name')!r}, "
                f"this one is {self.base.name!r}"
            )
        state = d.get("state", {})
        if sorted(state) != sorted(self.state.buffers):
            raise ValueError(
                f"optimizer state names {sorted(state)} differ from {sorted(self.state.buffers)}"
            )
        for key in state:
            check_names(f"optimizer state {key!r}", expected, state[key])
        model.load_full_parameters(d["params"])
        for key, local in self.state.buffers.items():
            model.load_state_tensors(state[key], local)
        self.restore_position(int(d["step"]), int(d.get("steps_taken", d["step"])),
                              d.get("data"))

    def restore_position(self, step: int, steps_taken: int, data: dict[str, Any] | None
                         ) -> None:
        """Continue from optimizer update ``step``, training step ``steps_taken`` and the
        sampler position ``data`` (kept for the sampler :meth:`optimize` makes when there is
        none yet). Not collective."""
        self.state.step = int(step)
        self.step_count = int(steps_taken)
        red = getattr(self, "redundancy", None)
        if red is not None:  # the copies no longer match the state: made anew before a step
            red.invalidate()
        for _, _, st in self.pieces:
            st.step = self.state.step
        if data:
            if self.sampler is not None:
                self.sampler.load_state_dict(data)
            else:
                self._data_state = dict(data)

    def save(self, path: str, *, keep: int | None = None,
             extra: dict[str, Any] | None = None, async_: bool = False) -> Any:
        """Save model and optimizer state as one parallel-HDF5 checkpoint at ``path``.

        Collective over the model's mesh (every rank). Each rank writes its own elements of
        the global named tensors; the file is written under a temporary name and renamed
        when complete, and the directory's ``latest`` pointer moves to it. Returns the path.
        Delegates to :func:`mpidist.checkpoint.training.save_training`.

        ``async_=True``: the state is copied into host memory (a pool reused from save to
        save) and the call returns an :class:`~mpidist.checkpoint.background.AsyncCheckpoint`
        while a background thread writes this rank's bytes; training may go on at once. The
        save commits (renamed, ``latest`` moved), collectively, at the first of: its
        ``wait()``; the next :meth:`step` at which every rank's write is done (while a save
        is in flight, each step begins with one allreduce of two integers over the mesh
        asking that); the next ``save`` or ``load``. A failed write raises the same
        :class:`~mpidist.checkpoint.CheckpointError` on every rank there, the previous
        checkpoint intact. At most one save is in flight. Only the default ``posix`` I/O
        mode writes in the background (``mpio`` and ``serial`` save before returning).
        """
        from mpidist.checkpoint.training import save_training

        model = self._require_model()
        return save_training(os.path.dirname(os.path.abspath(path)), self, step=self.state.step,
                             keep=keep, comm=model.mesh.comm, extra=extra, path=path,
                             async_=async_, owner=self if async_ else None)

    def load(self, path: str) -> dict[str, Any]:
        """Load a checkpoint saved by any strategy at any world size or mesh. Collective
        over the model's mesh; returns the checkpoint's attributes."""
        from mpidist.checkpoint.training import load_training

        model = self._require_model()
        return load_training(path, self, comm=model.mesh.comm)

    def serialize(self) -> bytes:
        """The whole training state as self-describing bytes (no pickle). Collective."""
        from mpidist.parallel.serialization import dumps

        return dumps(self.state_dict(), model_layout=self._require_model().global_layout)

    def deserialize(self, data: bytes) -> None:
        """Restore from :meth:`serialize` bytes of the same strategy and model. Not collective.

        Refuses bytes of another strategy, model (names or shapes) or format version with a
        ValueError that says what differs.
        """
        from mpidist.parallel.serialization import loads

        model = self._require_model()
        d = loads(data, expect_strategy=self.strategy, model_layout=model.global_layout)
        self.load_state_dict(d)


def check_names(what: str, expected: dict[str, tuple], got: dict[str, Any]) -> None:
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    shapes = sorted(
        f"{n}: {tuple(np.shape(got[n]))} != {expected[n]}"
        for n in set(expected) & set(got) if tuple(np.shape(got[n])) != tuple(expected[n])
    )
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unexpected:
            parts.append(f"unexpected {unexpected}")
        if shapes:
            parts.append(f"shape mismatch {shapes}")
        raise ValueError(f"{what} do not match the model: " + "; ".join(parts))

