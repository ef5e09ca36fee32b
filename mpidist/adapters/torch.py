"""Train a CPU ``torch.nn.Module`` with mpidist's DDP, ZeRO-1 and ZeRO-2 (optional extra).

:class:`TorchModule` exposes the mpidist module protocol for a torch module. When a strategy
binds it to its flat buffers, every trainable parameter's ``.data`` becomes a
``torch.from_numpy`` view of its slice of the flat parameter buffer and its ``.grad`` a view
of its slice of the flat gradient buffer. Torch's autograd accumulates into an existing
``.grad`` in place, so ``loss.backward()`` writes the gradients straight into the buffer the
strategy reduces over MPI, and mpidist's fused kernels update the parameters in place: no
copies between torch and mpidist on the training path.

Usage, under ``mpiexec -n N``::

    from mpidist.adapters.torch import wrap_torch, TorchLoss
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
    trainer = wrap_torch(net, strategy="zero2", optimizer=mpidist.optim.AdamW(lr=1e-3))
    for x, y in local_batches:          # this rank's slice of each global batch
        loss = trainer.step((x, y))     # global loss, the same on every rank

Losses follow mpidist's convention (default: mpidist's ``CrossEntropyLoss`` on the module's
output as NumPy); :class:`TorchLoss` runs a torch loss function instead.

The whole module is one unit by default. ``units="children"`` (an ``nn.Sequential``) makes
each child a unit: DDP's bucketed allreduces then start while backward continues through the
earlier children, and ZeRO-3 can run the model (correct, but torch's autograd graph keeps the
gathered parameters it saved for backward alive, so ZeRO-3's memory saving is not realised).

Limitations: CPU tensors only; the forward must return one tensor; module *buffers* (e.g.
BatchNorm running statistics) are neither synchronised nor checkpointed; parameters with
``requires_grad=False`` stay outside the flat buffers and are left untouched.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np
import torch

from mpidist.adapters.common import Trainer, make_optimizer
from mpidist.buffers import FlatBuffer
from mpidist.parallel import ShardedOptimizer, ShardingConfiguration
from mpidist.parallel.ddp import DDPModel
from mpidist.parallel.zero import ZeRO2Model

__all__ = ["TorchLoss", "TorchModule", "wrap_torch"]

_Entry = tuple[str, torch.nn.Parameter, bool]  # (full name, parameter, owned by this part)


class _TorchPart:
    """A callable torch (sub)module with the mpidist module protocol (one unit)."""

    def __init__(self, fn: torch.nn.Module, entries: list[_Entry], sources: dict[str, Any],
                 *, input_grad: bool) -> None:
        self.fn = fn
        self._entries = entries
        self._sources = sources  # shared with the root: consumed by init_parameters
        self._input_grad = input_grad
        self._cache: dict[Hashable, tuple[Any, Any]] = {}
        self._grad_ptrs: list[tuple[torch.nn.Parameter, int]] | None = None

    # -- names and shapes ------------------------------------------------------------------
    def named_parameter_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(full name, shape)`` of every trainable parameter this unit owns."""
        return [(n, tuple(p.shape)) for n, p, owned in self._entries if owned]

    def parameter_names(self, include_shared: bool = True) -> list[str]:
        """Names of the parameters this unit uses (with ``include_shared``, also those owned
        by an earlier unit: tied weights)."""
        return [n for n, _, owned in self._entries if owned or include_shared]

    def num_parameters(self) -> int:
        return int(sum(p.numel() for _, p, owned in self._entries if owned))

    # -- storage -------------------------------------------------------------------------
    def bind(self, params: Mapping[str, np.ndarray] | FlatBuffer,
             grads: Mapping[str, np.ndarray] | FlatBuffer | None = None) -> _TorchPart:
        """Make each parameter's ``.data`` (and ``.grad``) a torch view of the given arrays.

        Names not used here are ignored; a parameter shared with (owned by) another unit is
        skipped when its array is not given. Not collective."""
        if isinstance(params, FlatBuffer):
            params = params.views()
        if isinstance(grads, FlatBuffer):
            grads = grads.views()
        plan = []
        for name, p, owned in self._entries:
            if name not in params and not owned:
                continue
            arr = _lookup(params, name, tuple(p.shape), "parameter")
            g = None if grads is None else _lookup(grads, name, tuple(p.shape), "gradient")
            if g is not None and g.dtype != arr.dtype:
                raise ValueError(f"gradient {name!r} has dtype {g.dtype}, parameter {arr.dtype}")
            plan.append((p, arr, g))
        ptrs = []
        for p, arr, g in plan:
            p.grad = None  # a .grad of the old dtype would block the .data change
            p.data = torch.from_numpy(arr)
            if g is not None:
                gt = torch.from_numpy(g)
                p.grad = gt
                ptrs.append((p, gt.data_ptr()))
        self._grad_ptrs = ptrs if grads is not None else None
        return self

    def unbind(self) -> None:
        """Drop the gradient views. Parameter ``.data`` keeps pointing at the last bound
        arrays so the torch module stays usable (for inference) after training."""
        for _, p, _ in self._entries:
            p.grad = None
        self._grad_ptrs = None

    def init_parameters(self, seed: int = 0) -> None:
        """Copy the torch module's own initial values (as they were when the
        :class:`TorchModule` was made) into the bound storage. ``seed`` is unused: the
        strategies broadcast dp rank 0's values, so every replica starts from rank 0's
        torch initialisation."""
        for name, p, owned in self._entries:
            if not owned:
                continue
            src = self._sources.pop(name, None)
            if src is None:
                raise RuntimeError(
                    f"the initial value of {name!r} was already used; make a new TorchModule "
                    "(or call wrap_torch again) to wrap the torch module a second time"
                )
            with torch.no_grad():
                p.data.copy_(src)

    # -- compute ---------------------------------------------------------------------------
    def forward(self, x: Any, ctx: Hashable = None) -> np.ndarray:
        """Run the torch module with autograd on; keep its output for :meth:`backward`.
        Returns the output as a NumPy array sharing the tensor's memory. Not collective."""
        xt = self._to_tensor(x)
        with torch.enable_grad():
            out = self.fn(xt)
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"{type(self.fn).__name__} returned {type(out).__name__}; the "
                             "torch adapter needs a module whose forward returns one tensor")
        self._cache[ctx] = (xt, out)
        return out.detach().numpy()

    def backward(self, dy: Any, ctx: Hashable = None) -> np.ndarray | None:
        """``out.backward(dy)``: torch accumulates the parameter gradients in place into the
        bound gradient arrays. Returns the input gradient (None for the first unit)."""
        try:
            xt, out = self._cache.pop(ctx)
        except KeyError:
            raise RuntimeError(f"{type(self.fn).__name__}: backward with ctx={ctx!r} has no "
                               "matching forward") from None
        if self._grad_ptrs is None:
            raise RuntimeError("TorchModule.backward: no gradient storage is bound")
        dy_np = np.asarray(dy)
        want = _numpy_dtype(out.dtype)
        if dy_np.dtype != want or not dy_np.flags.c_contiguous:
            dy_np = np.ascontiguousarray(dy_np, dtype=want)
        out.backward(torch.from_numpy(dy_np))
        for p, ptr in self._grad_ptrs:
            # Torch accumulates into a defined .grad in place; if anything ever replaced it,
            # the gradient would silently miss the flat buffer, so check (a pointer compare).
            if p.grad is None or p.grad.data_ptr() != ptr:
                raise RuntimeError("torch replaced a parameter's .grad instead of accumulating "
                                   "into the flat gradient buffer (create_graph=True or a "
                                   "hook that assigns .grad is not supported)")
        if isinstance(xt, torch.Tensor) and xt.requires_grad:
            return xt.grad.numpy()
        return None

    def _to_tensor(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, np.ndarray):
            if x.dtype.kind == "f":
                dt = self._param_dtype()
                if dt is not None and x.dtype != dt:
                    x = x.astype(dt)
                t = torch.from_numpy(np.ascontiguousarray(x))
                if self._input_grad:
                    t.requires_grad_(True)
                return t
            return torch.from_numpy(np.ascontiguousarray(x))
        return x

    def _param_dtype(self) -> np.dtype | None:
        for _, p, _ in self._entries:
            return _numpy_dtype(p.dtype)
        return None

    def clear_cache(self) -> None:
        self._cache.clear()


class TorchModule(_TorchPart):
    """A CPU ``torch.nn.Module`` as an mpidist module (see the module docstring).

    Args:
        module: the torch module (CPU). Its current parameter values are the initial values.
        units: None (the whole module is one unit) or ``"children"`` (each child of an
            ``nn.Sequential`` is a unit).
    """

    def __init__(self, module: torch.nn.Module, *, units: str | None = None) -> None:
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"{type(module).__name__} has no trainable parameters")
        for n, p in named:
            if p.device.type != "cpu":
                raise ValueError(f"parameter {n!r} is on {p.device}; the torch adapter runs "
                                 "CPU modules (mpidist moves data with MPI on host memory)")
            if not p.dtype.is_floating_point:
                raise ValueError(f"parameter {n!r} has dtype {p.dtype}, expected float")
        # References, not copies: they keep the original storage alive only until
        # init_parameters has copied it into the strategy's buffer.
        sources = {n: p.detach() for n, p in named}
        super().__init__(module, [(n, p, True) for n, p in named], sources, input_grad=False)
        self.module = module
        if units is None:
            return
        if units != "children":
            raise ValueError(f"units={units!r} must be None or 'children'")
        if not isinstance(module, torch.nn.Sequential):
            raise ValueError(f"units='children' needs a torch.nn.Sequential, got "
                             f"{type(module).__name__}")
        name_of = {id(p): n for n, p in named}
        seen: set[int] = set()
        parts = []
        for i, child in enumerate(module.children()):
            entries = []
            for p in child.parameters():
                if id(p) not in name_of:
                    continue
                entries.append((name_of[id(p)], p, id(p) not in seen))
                seen.add(id(p))
            parts.append(_TorchPart(child, entries, sources, input_grad=i > 0))
        self.units = parts

    def bind(self, params: Mapping[str, np.ndarray] | FlatBuffer,
             grads: Mapping[str, np.ndarray] | FlatBuffer | None = None) -> TorchModule:
        super().bind(params, grads)
        if hasattr(self, "units"):
            # Backward runs unit by unit, so each unit must know the gradient views too.
            for unit in self.units:
                unit.bind(params, grads)
        return self

    def unbind(self) -> None:
        super().unbind()
        for unit in getattr(self, "units", ()):
            unit.unbind()

    def broadcast_initial_values(self, comm: Any) -> None:
        """Make the initial values (not yet copied in) those of rank 0 of ``comm``.
        Collective over ``comm``."""
        from mpidist import collectives as C

        for name in list(self._sources):
            arr = self._sources[name].numpy().copy()
            C.broadcast(arr, 0, comm=comm)
            self._sources[name] = torch.from_numpy(arr)

    def forward(self, x: Any, ctx: Hashable = None) -> np.ndarray:
        if not hasattr(self, "units"):
            return super().forward(x, ctx)
        h = x
        for unit in self.units:
            h = unit.forward(h, ctx)
        return h

    def backward(self, dy: Any, ctx: Hashable = None) -> np.ndarray | None:
        if not hasattr(self, "units"):
            return super().backward(dy, ctx)
        for unit in reversed(self.units):
            dy = unit.backward(dy, ctx)
        return dy

    def __repr__(self) -> str:
        n = len(self.units) if hasattr(self, "units") else 1
        return f"TorchModule({type(self.module).__name__}, units={n}, " \
               f"parameters={self.num_parameters()})"


class TorchLoss:
    """A torch loss function as an mpidist loss.

    ``fn(outputs, targets) -> scalar tensor`` with ``reduction`` saying whether it returns
    the sum or the mean over the samples (tokens, for integer targets of more than one axis)
    of the call, e.g. ``TorchLoss(lambda o, t: F.cross_entropy(o.flatten(0, -2),
    t.flatten(), reduction="sum"))``. It is rescaled to the global normaliser of the step.
    """

    def __init__(self, fn: Any, *, reduction: str = "sum") -> None:
        if not callable(fn):
            raise ValueError(f"fn={fn!r} is not callable")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction={reduction!r} must be 'mean' or 'sum'")
        self.fn = fn
        self.reduction = reduction
        self._cache: dict[Hashable, np.ndarray] = {}

    def forward(self, outputs: Any, targets: Any, normalizer: float | None = None,
                ctx: Hashable = None) -> float:
        y = np.asarray(targets)
        count = int(y.size) if y.dtype.kind in "iu" else (int(y.shape[0]) if y.ndim else 1)
        norm = float(count if normalizer is None else normalizer)
        if not norm > 0:
            raise ValueError(f"normalizer={normalizer!r} must be > 0")
        factor = (count if self.reduction == "mean" else 1) / norm
        out = torch.from_numpy(np.ascontiguousarray(outputs)).requires_grad_(True)
        with torch.enable_grad():
            loss = self.fn(out, torch.from_numpy(np.ascontiguousarray(y))) * factor
        loss.backward()
        self._cache[ctx] = out.grad.numpy()
        return float(loss.item())

    def backward(self, dy: float = 1.0, ctx: Hashable = None) -> np.ndarray:
        try:
            g = self._cache.pop(ctx)
        except KeyError:
            raise RuntimeError(f"TorchLoss.backward(ctx={ctx!r}) has no matching forward") \
                from None
        return g if dy == 1.0 else g * dy


def wrap_torch(module: torch.nn.Module, strategy: str | type[ShardedOptimizer] = "ddp",
               optimizer: Any = None, config: ShardingConfiguration | None = None, *,
               loss: Any = None, units: str | None = None, lr_schedule: Any = None,
               seed: int = 0) -> Trainer:
    """Wrap a CPU torch module for data-parallel training with an mpidist strategy.

    Collective over the mesh of ``config`` (default: every rank of COMM_WORLD
    data-parallel): the flat buffers are allocated, the torch module's values are copied in
    and broadcast from dp rank 0, and its parameters become views of the buffers.

    Args:
        module: the torch module (CPU).
        strategy: ``"ddp"``, ``"zero1"``, ``"zero2"`` (``"zero3"`` with ``units="children"``)
            or a ShardedOptimizer class.
        optimizer: an ``mpidist.optim`` optimizer or its name (default ``Adam()``).
        config: a :class:`ShardingConfiguration` (its ``dtype`` is the parameter dtype the
            torch module trains in: "float32" or "float64").
        loss: an mpidist loss (default ``CrossEntropyLoss``) or a :class:`TorchLoss`.
        units: see :class:`TorchModule`.

    Returns a :class:`~mpidist.adapters.Trainer`: ``trainer.step((x, y))`` with this rank's
    NumPy (or torch) inputs and targets returns the global loss.
    """
    adapter = module if isinstance(module, TorchModule) else TorchModule(module, units=units)
    opt = make_optimizer(strategy, optimizer, config, loss=loss, lr_schedule=lr_schedule)
    if not issubclass(opt.model_class, (DDPModel, ZeRO2Model)):
        # DDP, ZeRO-1 and ZeRO-2 broadcast the initial parameters from dp rank 0; ZeRO-3
        # takes each shard from its owner's own initialisation, which for a torch module
        # (random per process unless seeded alike) must first be made rank 0's.
        mesh = opt.config.mesh
        if mesh is not None:
            adapter.broadcast_initial_values(mesh.group("dp"))
        else:
            from mpi4py import MPI

            adapter.broadcast_initial_values(MPI.COMM_WORLD)
    return Trainer(adapter, opt, seed=seed)


def _numpy_dtype(dt: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dt).numpy().dtype


def _lookup(arrays: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...],
            what: str) -> np.ndarray:
    try:
        arr = arrays[name]
    except KeyError:
        raise ValueError(f"{what} {name!r} is missing from the arrays given to bind") from None
    if not isinstance(arr, np.ndarray) or tuple(arr.shape) != shape:
        raise ValueError(f"{what} {name!r} has shape {np.shape(arr)}, expected {shape}")
    if arr.dtype.kind != "f":
        raise ValueError(f"{what} {name!r} has dtype {arr.dtype}, expected a float type")
    return arr
