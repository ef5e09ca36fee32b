"""Saving and loading a training run (a strategy's model and optimizer) as a checkpoint.

The file holds, as global named tensors:

* ``params/<parameter name>``: every parameter with its single-process shape;
* ``optimizer/<state name>/<parameter name>``: every optimizer-state tensor
  (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...), with the parameter's shape;

* ``strategy/...``: state of the strategy itself, for strategies that have some (Local
  SGD's replicas, error-feedback residuals, async SGD's in-flight gradients);

and root attributes: ``step`` (optimizer updates), ``steps_taken``, ``strategy``, ``mesh``,
``world_size``, ``dtype``, ``optimizer`` (name and hyperparameters), ``data`` (the sampler's
epoch, step and samples seen), ``strategy_state`` and ``extra``.

A strategy with state of its own offers (duck-typed; this module knows no strategy)
``strategy_state_attrs()`` (JSON, collective: it may complete pending exchanges),
``strategy_state_tensors()``, ``strategy_state_pieces(for_writing=...)``, and for loading
``prepare_strategy_state(attrs) -> bool`` (checks, may raise ValueError) and
``finish_strategy_state()``. A checkpoint's strategy state is ignored by a strategy of
another kind, which starts its own state afresh. Each rank writes only the elements it owns and
reads only what its own layout needs, so a checkpoint saved by any strategy on any mesh
loads into any other.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from mpidist.checkpoint.background import wait_in_flight
from mpidist.checkpoint.format import CheckpointMismatchError, Piece, TensorInfo
from mpidist.checkpoint.io import (
    checkpoint_path,
    latest_checkpoint,
    read_metadata,
    read_pieces,
    save_checkpoint,
)
from mpidist.core.arrays import as_like, is_host, to_host

__all__ = ["load_training", "save_training", "training_tensors"]


def _model(opt: Any) -> Any:
    model = getattr(opt, "model", None)
    if model is None or getattr(opt, "state", None) is None:
        raise ValueError(f"{type(opt).__name__} has no model yet; call wrap() before saving")
    return model


def _has_state(opt: Any) -> bool:
    return hasattr(opt, "strategy_state_tensors")


def training_tensors(opt: Any, *, strategy_state: bool = True) -> dict[str, TensorInfo]:
    """The global tensors a checkpoint of ``opt`` holds: ``{name: TensorInfo}``."""
    model = _model(opt)
    dtype = np.dtype(model.dtype).name
    # A pipeline or tensor-parallel model holds only part of the model; it knows the
    # global shapes of every tensor.
    shapes = model.tensor_shapes()
    out = {f"params/{n}": TensorInfo(shape, dtype) for n, shape in shapes.items()}
    for key in opt.state.buffers:
        out.update({f"optimizer/{key}/{n}": TensorInfo(shape, dtype)
                    for n, shape in shapes.items()})
    if strategy_state and _has_state(opt):
        out.update({n: TensorInfo(shape, dt)
                    for n, (shape, dt) in opt.strategy_state_tensors().items()})
    return out


def _pieces(opt: Any, *, for_writing: bool, strategy_state: bool = True) -> list[Piece]:
    model = _model(opt)
    out = [Piece(n, s, d) for n, s, d in
           model.checkpoint_pieces(opt.state.buffers, for_writing=for_writing)]
    if strategy_state and _has_state(opt):
        out += [Piece(n, s, d) for n, s, d in
                opt.strategy_state_pieces(for_writing=for_writing)]
    return out


def _on_host(pieces: list[Piece]) -> tuple[list[Piece], list[tuple[Any, np.ndarray]]]:
    """The pieces with device data replaced by host arrays (copies of it), and the
    ``(device array, host array)`` pairs to copy back after a read. The file format does
    not change with the device: a checkpoint written on a GPU loads on the CPU and back."""
    out, back = [], []
    for p in pieces:
        if is_host(p.data):
            out.append(p)
            continue
        host = to_host(p.data)
        out.append(Piece(p.name, p.flat, host))
        back.append((p.data, host))
    return out, back


def save_training(directory: str, opt: Any, *, step: int, keep: int | None = None,
                  comm: Any = None, extra: dict[str, Any] | None = None,
                  path: str | None = None, async_: bool = False, owner: Any = None) -> Any:
    """Save ``opt``'s model and optimizer state as ``directory/ckpt-<step>.h5``.

    Collective over ``comm`` (every rank of the job): each rank writes its own elements.
    The save is atomic and moves the ``latest`` pointer; with ``keep`` only the newest
    ``keep`` checkpoints stay. Returns the path; with ``async_``, the
    :class:`~mpidist.checkpoint.background.AsyncCheckpoint` of a save that copied the state
    into host memory (from a GPU too) and writes it in the background (``owner``: the
    optimizer whose steps poll it, or None; see :func:`~mpidist.checkpoint.io.save_checkpoint`).
    """
    wait_in_flight(int(opt.step_count))  # the strategy state below may be collective
    model = _model(opt)
    shape = model.mesh.shape
    state = opt.strategy_state_attrs() if _has_state(opt) else {}
    attrs = {
        "step": int(opt.state.step),
        "steps_taken": int(opt.step_count),
        "strategy": opt.strategy,
        "mesh": {"pp": shape.pp, "dp": shape.dp, "tp": shape.tp},
        "world_size": int(shape.size),
        "dtype": np.dtype(model.dtype).name,
        "optimizer": opt.base.config(),
        "data": None if opt.sampler is None else opt.sampler.state_dict(),
        "strategy_state": state,
        "extra": extra or {},
    }
    if getattr(opt, "scaler", None) is not None:
        attrs["loss_scale"] = opt.scaler.state_dict()
    target = path if path is not None else checkpoint_path(directory, step)
    if async_:  # the snapshot copies device pieces to host memory itself
        return save_checkpoint(target, training_tensors(opt), _pieces(opt, for_writing=True),
                               attrs, comm=comm, keep=keep, async_=True, owner=owner)
    pieces, _ = _on_host(_pieces(opt, for_writing=True))
    return save_checkpoint(target, training_tensors(opt), pieces, attrs, comm=comm, keep=keep)


def load_training(path: str, opt: Any, *, comm: Any = None, verify: bool = True
                  ) -> dict[str, Any]:
    """Load a checkpoint (a file, or a directory's latest) into ``opt`` and its model.

    Collective over ``comm``. The checkpoint may come from any strategy, world size or
    mesh; the tensors must match this model and optimizer exactly (names, shapes,
    dtypes), else a :class:`CheckpointMismatchError` lists what differs. Restores the
    parameters, the optimizer state, the step counts and the data position; returns the
    checkpoint's attributes.
    """
    wait_in_flight(getattr(opt, "step_count", None))  # a load reads what the save in flight commits
    if os.path.isdir(path):
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointMismatchError(f"no checkpoint in directory {path!r}")
        path = found
    attrs, stored = read_metadata(path)
    theirs = attrs.get("optimizer", {}).get("name")
    if theirs != opt.base.name:
        raise CheckpointMismatchError(
            f"{path!r} holds optimizer {theirs!r} state; this run uses {opt.base.name!r}"
        )
    use = _has_state(opt) and opt.prepare_strategy_state(attrs.get("strategy_state") or None)
    # Another strategy's state in the file is not an error: this strategy starts afresh.
    strict = use or not any(n.startswith("strategy/") for n in stored)
    pieces, back = _on_host(_pieces(opt, for_writing=False, strategy_state=use))
    read_pieces(path, pieces, comm=comm, expected=training_tensors(opt, strategy_state=use),
                strict=strict, verify=verify)
    for device_array, host in back:
        device_array[...] = as_like(device_array, host)
    if use:
        opt.finish_strategy_state()
    scaler = getattr(opt, "scaler", None)  # fp16's loss scale continues where it was
    if scaler is not None and attrs.get("loss_scale"):
        scaler.load_state_dict(attrs["loss_scale"])
    refresh = getattr(_model(opt), "sync_compute_parameters", None)  # mixed precision
    if refresh is not None:
        refresh()
    opt.restore_position(int(attrs["step"]), int(attrs.get("steps_taken", attrs["step"])),
                         attrs.get("data"))
    return attrs
