"""Checkpoints of torch models and optimizers in mpidist's HDF5 format of global tensors.

The file holds ``params/<name>``, ``buffers/<name>`` (persistent buffers) and
``optimizer/<key>/<name>`` (per-parameter state: ``exp_avg``, the 0-d ``step``, ...) with
their global shapes, named as in the unwrapped module, and the attributes ``step``,
``wrapper``, ``world_size`` and ``optimizer`` (class, groups' hyperparameters and parameter
names, non-tensor state). Each rank writes and reads only its part: its ``fully_shard``
rows, its ``ZeroRedundancyOptimizer`` partition, an even share of replicated tensors, or
the rows of a DTensor redistributed so that every mesh dimension shards dimension 0 (one
contiguous range per rank; a range several ranks hold is written by the first).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mpidist import checkpoint as ckpt
from mpidist.checkpoint.agreement import on_root
from mpidist.core.buffers import row_range
from mpidist.torch._common import numpy_dtype, resolve_comm
from mpidist.torch.ddp import DistributedDataParallel
from mpidist.torch.zero import ZeroRedundancyOptimizer

__all__ = ["load_checkpoint", "save_checkpoint"]


@dataclass
class _Entry:
    """One local tensor of the checkpoint and the part of the global tensor it holds."""

    name: str
    tensor: torch.Tensor
    shape: tuple[int, ...]       # global shape
    flat: slice | None           # this rank's elements of the global tensor; None: all
    layout: _Rows | None = None  # a DTensor's: how its rows come and go
    target: Any = None           # and the DTensor itself, which a load writes


def _is_dtensor(t: Any) -> bool:
    return all(hasattr(t, a) for a in ("device_mesh", "placements", "to_local"))


class _Rows:
    """A DTensor (torch's FSDP2, tensor parallelism, both) as contiguous rows: its values
    redistributed so that every dimension of its mesh shards dim 0, which leaves each rank
    one flat range of the global tensor. Making the rows and putting them back are
    collective over the DTensor's mesh."""

    def __init__(self, t: Any) -> None:
        from torch.distributed.tensor import Replicate, Shard

        self.mesh, self.placements = t.device_mesh, tuple(t.placements)
        self.shape, self.stride = tuple(t.shape), t.stride()
        self.rows = tuple(Shard(0) if t.dim() else Replicate() for _ in range(self.mesh.ndim))
        start, stop = 0, self.shape[0] if self.shape else 1
        coordinate = (self.mesh.get_coordinate() or ()) if t.dim() else ()
        for dim, c in enumerate(coordinate):
            lo, hi = row_range(stop - start, c, self.mesh.size(dim))
            start, stop = start + lo, start + hi
        row = math.prod(self.shape[1:])
        self.local_shape = (stop - start, *self.shape[1:]) if self.shape else ()
        self.flat = slice(start * row, stop * row)

    def local(self, t: Any) -> torch.Tensor:
        """This rank's rows of ``t`` (a DTensor laid out like the one this was made for)."""
        if tuple(t.placements) != self.rows:
            t = t.redistribute(self.mesh, self.rows)
        out = t.to_local()
        if tuple(out.shape) != self.local_shape:
            raise ValueError(f"rows of a DTensor of shape {self.shape}: torch gives this rank "
                             f"{tuple(out.shape)}, expected {self.local_shape}")
        return out

    def restore(self, rows: torch.Tensor) -> Any:
        """The DTensor, in the original placements, whose rows here are ``rows``."""
        from torch.distributed.tensor import DTensor

        t = DTensor.from_local(rows.view(self.local_shape), self.mesh, self.rows,
                               run_check=False, shape=torch.Size(self.shape),
                               stride=self.stride)
        return t.redistribute(self.mesh, self.placements) if self.placements != self.rows \
            else t


def _entry(name: str, t: Any, info: Any = None, values: bool = True) -> _Entry:
    """The entry of a parameter, buffer or state tensor ``t`` (``info``: mpidist's
    fully_shard; a DTensor: its rows, redistributed only when ``values`` are wanted: a load
    needs just their shape)."""
    if _is_dtensor(t):
        layout = _Rows(t)
        rows = layout.local(t) if values else torch.empty(layout.local_shape, dtype=t.dtype)
        return _Entry(name, rows, layout.shape, layout.flat, layout, target=t)
    if info is not None:
        return _Entry(name, t, info.shape, info.flat)
    return _Entry(name, t, tuple(t.shape), None)


def _unwrap(module: torch.nn.Module, optimizer: Any, comm: Any) -> tuple[torch.nn.Module, Any,
                                                                          str]:
    """The plain module, the communicator everyone uses, and a name for the wrapper."""
    comms = []
    wrapper = "module"
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):  # torch's own
        module = module.module
        wrapper = "torch.DistributedDataParallel"
    if isinstance(module, DistributedDataParallel):
        comms.append(module.comm)
        module = module.module
        wrapper = "DistributedDataParallel"
    for p in module.parameters():
        info = getattr(p, "_mpidist_shard", None)
        if info is not None:
            comms.append(info.comm)
            wrapper = "fully_shard"
            break
        if _is_dtensor(p):
            wrapper = "torch DTensor (fully_shard / tensor parallel)"
            break
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        comms.append(optimizer.comm)
        wrapper += "+ZeroRedundancyOptimizer"
    if comm is not None:
        comms.append(comm)
    chosen = resolve_comm(comms[0] if comms else None)
    from mpi4py import MPI

    for c in comms[1:]:
        if MPI.Comm.Compare(c, chosen) not in (MPI.IDENT, MPI.CONGRUENT):
            raise ValueError("the module, the optimizer and comm= use different "
                             "communicators; pass one group")
    return module, chosen, wrapper


def _model_entries(module: torch.nn.Module, values: bool = True) -> list[_Entry]:
    keys = set(module.state_dict().keys())
    out = []
    for name, p in module.named_parameters():
        out.append(_entry(f"params/{name}", p, getattr(p, "_mpidist_shard", None), values))
    for name, b in module.named_buffers():
        if name in keys:
            out.append(_entry(f"buffers/{name}", b, values=values))
    return out


def _param_names(module: torch.nn.Module, optimizer: Any) -> dict[torch.Tensor, str]:
    names = {p: n for n, p in module.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in names:
                raise ValueError("the optimizer holds a parameter that is not the module's; "
                                 "pass the module the optimizer was built for")
    return names


def _local_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _optimizer_entries(module: torch.nn.Module, optimizer: Any) -> tuple[list[_Entry],
                                                                          dict[str, Any]]:
    """State tensors as entries; hyperparameters and non-tensor state as attributes."""
    names = _param_names(module, optimizer)
    local = _local_optimizer(optimizer)
    entries = []
    scalars: dict[str, dict[str, Any]] = {}
    for p, state in local.state.items():
        name = names[p]
        info = getattr(p, "_mpidist_shard", None)
        for key, v in state.items():
            if not torch.is_tensor(v):
                scalars.setdefault(name, {})[key] = v
                continue
            if v.dim() == 0:
                local_v = v.full_tensor() if _is_dtensor(v) else v
                entries.append(_Entry(f"optimizer/{key}/{name}", local_v, (), None))
            elif v.shape == p.shape:
                entries.append(_entry(f"optimizer/{key}/{name}", v, info))
            else:
                raise ValueError(f"optimizer state {key!r} of {name!r} has shape "
                                 f"{tuple(v.shape)}, neither the parameter's nor a scalar")
    groups = []
    for group in optimizer.param_groups:
        g = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
             if k != "params" and _plain(v)}
        g["params"] = [names[p] for p in group["params"]]
        groups.append(g)
    attrs = {"class": type(local).__name__, "param_groups": groups, "scalars": scalars}
    return entries, attrs


def _plain(v: Any) -> bool:
    if isinstance(v, list | tuple):
        return all(_plain(x) for x in v)
    return v is None or isinstance(v, bool | int | float | str)


def save_checkpoint(path: str | os.PathLike[str], module: torch.nn.Module,
                    optimizer: Any = None, *, step: int | None = None, comm: Any = None,
                    keep: int | None = None, async_: bool = False) -> Any:
    """Write ``module`` (and ``optimizer``'s state) to one HDF5 checkpoint at ``path``.

    Collective over the wrappers' communicator (or ``comm``, default every rank): every rank
    calls it with the same ``path``, ``step``, ``keep`` and ``async_``. ``module`` is a plain
    module, a :class:`DistributedDataParallel` or a model built with ``fully_shard``;
    ``optimizer`` any torch optimizer over its parameters or a
    :class:`ZeroRedundancyOptimizer`. The write is atomic (a failure leaves the previous
    checkpoint intact) and moves the directory's ``latest`` pointer; ``keep`` keeps only the
    newest checkpoints. Returns the path.

    ``async_=True``: this rank's part is copied into host memory (a pool reused from save
    to save; pinned memory for CUDA tensors, copied straight from the device) and an
    :class:`~mpidist.checkpoint.background.AsyncCheckpoint` is returned while a background
    thread writes it: the module and optimizer may change at once. The save commits,
    collectively over the same ranks, in the handle's ``wait()`` (or ``poll()``, when every
    rank is done) or at the next ``save_checkpoint`` of this process, which first waits for
    it; a failed write raises the same error on every rank there. Only the default
    ``posix`` I/O mode writes in the background.
    """
    module, comm, wrapper = _unwrap(module, optimizer, comm)
    entries = _model_entries(module)
    attrs: dict[str, Any] = {"step": -1 if step is None else int(step), "wrapper": wrapper,
                             "strategy": f"torch:{wrapper}", "world_size": comm.Get_size(),
                             "format_source": "mpidist.torch"}
    if optimizer is not None:
        extra, attrs["optimizer"] = _optimizer_entries(module, optimizer)
        entries += extra
    mine = {e.name: (e.shape, numpy_dtype(e.tensor.dtype).name,
                     None if e.flat is None else (e.flat.start, e.flat.stop))
            for e in entries}
    everyone = comm.allgather(mine) if comm.Get_size() > 1 else [mine]
    tensors: dict[str, ckpt.TensorInfo] = {}
    holders: dict[str, list[int]] = {}
    writer: dict[tuple[str, int, int], int] = {}  # a range held by several ranks: the first
    for r, table in enumerate(everyone):
        for name, (shape, dtype, flat) in table.items():
            tensors.setdefault(name, ckpt.TensorInfo(shape, dtype))
            holders.setdefault(name, []).append(r)
            if flat is not None:
                writer.setdefault((name, *flat), r)
    pieces = []
    rank = comm.Get_rank()
    for e in entries:
        data = _flat_values(e.tensor, async_)
        if e.flat is not None:
            if writer[(e.name, e.flat.start, e.flat.stop)] == rank:
                pieces.append(ckpt.Piece(e.name, e.flat, data))
            continue
        who = holders[e.name]  # ranks with the whole tensor: each writes an even share
        i = who.index(rank)
        lo, hi = row_range(data.size, i, len(who))
        if hi > lo or (data.size == 0 and i == 0):
            pieces.append(ckpt.Piece(e.name, slice(lo, hi), data[lo:hi]))
    return ckpt.save_checkpoint(path, tensors, pieces, attrs, comm=comm, keep=keep,
                                async_=async_)


def _flat_values(t: torch.Tensor, direct: bool) -> Any:
    """A tensor's elements as a flat array to save: a NumPy view of a CPU tensor (an
    asynchronous save copies it), a copy of a device tensor, or with ``direct`` the device
    tensor itself as a Numba device array (the save's snapshot copies it into pinned
    memory)."""
    flat = t.detach().reshape(-1)
    if direct and flat.device.type == "cuda":
        from mpidist.core.devices import view

        return view(flat.contiguous())
    return flat.cpu().numpy()


def load_checkpoint(path: str | os.PathLike[str], module: torch.nn.Module,
                    optimizer: Any = None, *, comm: Any = None,
                    strict: bool = True) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` into ``module`` (and
    ``optimizer``), whatever wrapper and world size wrote it. Returns its attributes
    (``step``, ...).

    Collective over the wrappers' communicator (or ``comm``); ``path`` may be a checkpoint
    directory (its ``latest`` checkpoint is read). Every rank reads only the parts its own
    wrapper holds; checksums are verified. A missing tensor or a different global shape
    raises the same ``CheckpointMismatchError`` on every rank before any data is read;
    ``strict=False`` also accepts files with extra tensors (always accepted for optimizer
    state when ``optimizer`` is None).
    """
    module, comm, _ = _unwrap(module, optimizer, comm)
    path = os.fspath(path)

    def header() -> tuple[str, dict[str, Any], dict[str, ckpt.TensorInfo]]:
        target = ckpt.latest_checkpoint(path) if os.path.isdir(path) else path
        if target is None:
            raise ckpt.CheckpointError(f"no checkpoint in {path!r}")
        return (target, *ckpt.read_metadata(target))

    target, attrs, infos = on_root(comm, header)  # every rank raises rank 0's error
    entries = _model_entries(module, values=False)
    expected = {e.name: ckpt.TensorInfo(e.shape, numpy_dtype(e.tensor.dtype).name)
                for e in entries}
    loaders: list[tuple[_Entry, torch.Tensor]] = []
    requests = []
    for e in entries:
        buf = torch.empty(e.tensor.numel(), dtype=e.tensor.dtype)
        requests.append(ckpt.Piece(e.name, e.flat or slice(0, buf.numel()), buf.numpy()))
        loaders.append((e, buf))
    states: dict[torch.Tensor, dict[str, Any]] = {}
    if optimizer is not None:
        _plan_optimizer(module, optimizer, attrs, infos, requests, states)
    extra = sorted(n for n in infos if n.startswith(("params/", "buffers/"))
                   and n not in expected)
    if strict and extra:
        raise ckpt.CheckpointMismatchError(
            f"{target!r} holds tensors the module lacks: {extra[:8]}"
            + (f" and {len(extra) - 8} more" if len(extra) > 8 else "")
            + "; pass strict=False to ignore them")
    ckpt.read_pieces(target, requests, comm=comm, expected=expected, strict=False,
                     verify=True)
    with torch.no_grad():
        for e, buf in loaders:
            if e.layout is not None:
                e.target.to_local().copy_(e.layout.restore(buf).to_local())
            else:
                e.tensor.copy_(buf.view(e.tensor.shape))
    if optimizer is not None:
        _apply_optimizer(module, optimizer, attrs, states)
    return dict(attrs)


def _plan_optimizer(module: torch.nn.Module, optimizer: Any, attrs: Mapping[str, Any],
                    infos: Mapping[str, Any], requests: list[Any],
                    states: dict[torch.Tensor, dict[str, Any]]) -> None:
    """Requests for the optimizer state of the parameters this rank's optimizer updates."""
    if "optimizer" not in attrs:
        raise ckpt.CheckpointMismatchError("the checkpoint holds no optimizer state")
    names = _param_names(module, optimizer)
    saved: dict[str, list[tuple[str, str, Any]]] = {}  # parameter name -> its state tensors
    for key_name, tinfo in infos.items():
        kind, *rest = key_name.split("/", 2)
        if kind == "optimizer" and len(rest) == 2:
            saved.setdefault(rest[1], []).append((rest[0], key_name, tinfo))
    for group in _local_optimizer(optimizer).param_groups:
        for p in group["params"]:
            state: dict[str, Any] = {}
            for key, key_name, tinfo in saved.get(names[p], []):
                dtype = getattr(torch, np.dtype(tinfo.dtype).name)
                if tuple(tinfo.shape) == ():
                    t, flat, layout = torch.empty((), dtype=dtype), slice(0, 1), None
                else:  # laid out as the parameter
                    e = _entry(key_name, p, getattr(p, "_mpidist_shard", None), values=False)
                    t = torch.empty(e.tensor.shape, dtype=dtype)
                    flat, layout = e.flat or slice(0, t.numel()), e.layout
                requests.append(ckpt.Piece(key_name, flat, t.view(-1).numpy()))
                state[key] = t if layout is None else (layout, t)
            if state:
                states[p] = state


def _apply_optimizer(module: torch.nn.Module, optimizer: Any, attrs: Mapping[str, Any],
                     states: dict[torch.Tensor, dict[str, Any]]) -> None:
    saved = attrs["optimizer"]
    names = _param_names(module, optimizer)
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ckpt.CheckpointMismatchError(
            f"the checkpoint's optimizer has {len(groups)} parameter groups, this one "
            f"{len(optimizer.param_groups)}")
    for g, (s, mine) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        if sorted(s["params"]) != sorted(names[p] for p in mine["params"]):
            raise ckpt.CheckpointMismatchError(f"parameter group {g} holds other parameters "
                                               "in the checkpoint")
        for k, v in s.items():
            if k != "params" and k in mine:
                mine[k] = tuple(v) if isinstance(mine[k], tuple) else v
    local = _local_optimizer(optimizer)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.sync_param_groups(optimizer.param_groups, local.param_groups)
    scalars = saved.get("scalars", {})
    for p, state in states.items():
        device = p.device
        full = {k: v[0].restore(v[1]) if isinstance(v, tuple) else v.to(device)
                for k, v in state.items()}
        full.update(scalars.get(names[p], {}))
        local.state[p] = full
