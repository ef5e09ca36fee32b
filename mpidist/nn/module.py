"""Module: a layer with explicit forward and backward whose parameters live in flat buffers.

A module *declares* its parameters (name, shape, init recipe) when it is constructed but holds
no storage. :meth:`Module.bind` points each parameter and gradient at arrays supplied by the
caller — normally views into two :class:`~mpidist.core.buffers.FlatBuffer` objects with identical
layouts — and :meth:`Module.unbind` drops them again (ZeRO-3 frees a gathered unit this way).

Every module knows its full dotted prefix in the tree (``"blocks.0.attn."``), so a sub-tree
bound on its own takes the same ``{full_name: array}`` dictionaries as the whole model and
ignores names it does not own.

Forward keeps what backward needs in ``self._cache[ctx]``; backward pops it. ``ctx`` is any
hashable key (default ``None``), so several micro-batches can be in flight at once, as a
pipeline schedule needs: run ``forward(x, ctx=i)`` for several ``i`` and later
``backward(dy, ctx=i)`` in any order. Backward *accumulates* (``+=``) into the bound gradient
arrays and returns the gradient of the input.

Backward also comes in two halves, for a zero-bubble pipeline schedule (Qi et al. 2024):
``backward_input(dy, ctx)`` returns the input gradient (the "B" pass, on the critical path)
and keeps what the weight gradients need, and ``backward_weight(ctx)`` later accumulates them
(the "W" pass, deferred into the pipeline bubble). Together they give bit for bit what
``backward(dy, ctx)`` gives (the same operations), with no forward recomputed.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from mpidist.core.arrays import as_like, is_floating
from mpidist.core.buffers import FlatBuffer

from .init import init_value

__all__ = ["Module", "ParamSpec", "UnboundParameterError"]


class UnboundParameterError(RuntimeError):
    """A module was run while its parameters (or gradients) are not bound to storage."""


@dataclass(frozen=True)
class ParamSpec:
    """A declared parameter: local name, shape and initialisation recipe."""

    name: str
    shape: tuple[int, ...]
    kind: str = "normal"
    scale: float = 0.02


class Module:
    """Base class of every layer and model.

    Subclasses call ``super().__init__()`` first, declare parameters with
    :meth:`register_parameter`, assign child modules as attributes (they are registered
    automatically, in assignment order) and implement ``forward(x, ctx=None)`` and
    ``backward(dy, ctx=None) -> dx``.
    """

    def __init__(self) -> None:
        d = self.__dict__
        d["_specs"] = {}  # local name -> ParamSpec (owned parameters)
        d["_shared"] = {}  # local name -> (owner module, owner's local name)
        d["_children"] = {}  # attribute name -> Module
        d["_params"] = {}  # local name -> bound array or None
        d["_grads"] = {}
        d["_cache"] = {}  # ctx -> whatever backward needs
        d["_deferred"] = {}  # ctx -> what backward_weight needs (kept by backward_input)
        d["prefix"] = ""
        d["training"] = True

    # -- registration -------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, Module):
            if "_children" not in self.__dict__:
                raise RuntimeError(
                    f"{type(self).__name__}.__init__ must call super().__init__() "
                    f"before assigning the submodule {name!r}"
                )
            self._children[name] = value
            value._set_prefix(f"{self.prefix}{name}.")
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: parameters are read through here.
        d = self.__dict__
        if name in d.get("_specs", ()) or name in d.get("_shared", ()):
            return self.param(name)
        raise AttributeError(f"{type(self).__name__!s} object has no attribute {name!r}")

    def _set_prefix(self, prefix: str) -> None:
        self.__dict__["prefix"] = prefix
        for child_name, child in self._children.items():
            child._set_prefix(f"{prefix}{child_name}.")

    def register_parameter(
        self, name: str, shape: tuple[int, ...], kind: str = "normal", scale: float = 0.02
    ) -> None:
        """Declare an owned parameter ``name`` of ``shape`` with its init recipe."""
        if name in self._specs or name in self._shared or name in self._children:
            raise ValueError(f"{type(self).__name__} already has a member named {name!r}")
        self._specs[name] = ParamSpec(name, tuple(int(s) for s in shape), kind, float(scale))
        self._params[name] = None
        self._grads[name] = None

    def register_shared(self, name: str, owner: Module, owner_name: str) -> None:
        """Use parameter ``owner_name`` of ``owner`` under the local name ``name`` (weight tying).

        The parameter is not listed by this module's :meth:`named_parameter_shapes` (the owner
        lists it once), but :meth:`bind` binds it too, so gradients from both uses accumulate
        into the same array.
        """
        if owner_name not in owner._specs:
            raise ValueError(f"{type(owner).__name__} has no parameter named {owner_name!r}")
        self._shared[name] = (owner, owner_name)
        self._params[name] = None
        self._grads[name] = None

    # -- names and shapes ---------------------------------------------------------------
    @property
    def name(self) -> str:
        """Full dotted name of this module (``"<root>"`` for the root)."""
        return self.prefix[:-1] if self.prefix else "<root>"

    def full_name(self, local: str) -> str:
        """Full dotted name of this module's parameter ``local``."""
        if local in self._shared:
            owner, owner_name = self._shared[local]
            return owner.full_name(owner_name)
        return f"{self.prefix}{local}"

    def children(self) -> Iterator[Module]:
        """Direct submodules in registration order."""
        return iter(self._children.values())

    def named_modules(self) -> Iterator[tuple[str, Module]]:
        """``(full name, module)`` for this module and every descendant, depth first."""
        yield self.name, self
        for child in self._children.values():
            yield from child.named_modules()

    def named_parameter_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(full name, shape)`` of every owned parameter in the tree, in registration order.

        This is the layout of the model's flat buffers. Tied (shared) parameters appear once,
        under their owner's name.
        """
        out = [(f"{self.prefix}{s.name}", s.shape) for s in self._specs.values()]
        for child in self._children.values():
            out.extend(child.named_parameter_shapes())
        return out

    def parameter_names(self, include_shared: bool = True) -> list[str]:
        """Full names of the parameters this tree needs bound.

        With ``include_shared`` (the default) parameters owned elsewhere but used here through
        weight tying are included (once), so a strategy gathering one unit knows everything
        the unit reads.
        """
        names: list[str] = []
        seen: set[str] = set()
        for mod in self.modules():
            locals_ = list(mod._specs) + (list(mod._shared) if include_shared else [])
            for local in locals_:
                full = mod.full_name(local)
                if full not in seen:
                    seen.add(full)
                    names.append(full)
        return names

    def num_parameters(self) -> int:
        """Number of scalar parameters owned by this tree."""
        return int(sum(int(np.prod(s)) for _, s in self.named_parameter_shapes()))

    def modules(self) -> Iterator[Module]:
        """This module and every descendant, depth first."""
        yield self
        for child in self._children.values():
            yield from child.modules()

    def own_parameter_specs(self) -> list[ParamSpec]:
        """The specs (name, shape, kind, scale) of the parameters this module registered
        itself (not its children's), in registration order."""
        return list(self._specs.values())

    # -- binding ------------------------------------------------------------------------
    def bind(
        self,
        params: Mapping[str, np.ndarray] | FlatBuffer,
        grads: Mapping[str, np.ndarray] | FlatBuffer | None = None,
    ) -> Module:
        """Point every parameter (and gradient) of the tree at arrays keyed by full name.

        Names the tree does not own are ignored, so a unit can be bound with the views of the
        whole model's buffers. Missing names or wrong shapes raise ``ValueError``. With
        ``grads=None`` gradients are left unbound and backward raises. Returns ``self``.
        """
        if isinstance(params, FlatBuffer):
            params = params.views()
        if isinstance(grads, FlatBuffer):
            grads = grads.views()
        # Validate everything first so a failed bind leaves the module unchanged.
        plan: list[tuple[Module, str, np.ndarray, np.ndarray | None]] = []
        for mod in self.modules():
            for local in list(mod._specs) + list(mod._shared):
                full = mod.full_name(local)
                shape = mod._shape_of(local)
                p = _lookup(params, full, shape, "parameter")
                g = None if grads is None else _lookup(grads, full, shape, "gradient")
                if g is not None and g.dtype != p.dtype and not (
                        p.dtype.itemsize == 2 and g.dtype == np.float32):
                    raise ValueError(  # mixed precision: 16-bit parameters, float32 gradients
                        f"gradient {full!r} has dtype {g.dtype} but the parameter has {p.dtype}"
                    )
                plan.append((mod, local, p, g))
        for mod, local, p, g in plan:
            mod._params[local] = p
            mod._grads[local] = g
        return self

    def unbind(self) -> None:
        """Drop every parameter and gradient reference in the tree.

        Cached activations are kept: ZeRO-3 frees a unit's gathered parameters after its
        forward and re-binds them for its backward, which still needs the activations. Use
        :meth:`clear_cache` to drop those too.
        """
        for mod in self.modules():
            for local in mod._params:
                mod._params[local] = None
                mod._grads[local] = None

    @property
    def is_bound(self) -> bool:
        """Whether every parameter of the tree is bound."""
        return all(p is not None for mod in self.modules() for p in mod._params.values())

    def _shape_of(self, local: str) -> tuple[int, ...]:
        if local in self._shared:
            owner, owner_name = self._shared[local]
            return owner._specs[owner_name].shape
        return self._specs[local].shape

    def param(self, local: str) -> np.ndarray:
        """The bound array of parameter ``local``; raises if unbound."""
        p = self._params.get(local)
        return self._unbound(local, "parameter") if p is None else p

    def grad(self, local: str) -> np.ndarray:
        """The bound gradient array of parameter ``local``; raises if unbound."""
        g = self._grads.get(local)
        return self._unbound(local, "gradient of") if g is None else g

    def _unbound(self, local: str, what: str) -> NoReturn:
        if local not in self._params:
            raise KeyError(f"{self.name} has no parameter {local!r}")
        raise UnboundParameterError(
            f"{what} {self.full_name(local)!r} is not bound to storage; call model.build() or "
            "module.bind(params, grads) before running the module"
        )

    def parameters(self) -> dict[str, np.ndarray]:
        """``{full name: bound array}`` of the owned parameters of the tree."""
        return {f"{m.prefix}{local}": m.param(local) for m in self.modules() for local in m._specs}

    def gradients(self) -> dict[str, np.ndarray]:
        """``{full name: bound gradient array}`` of the owned parameters of the tree."""
        return {f"{m.prefix}{local}": m.grad(local) for m in self.modules() for local in m._specs}

    @property
    def dtype(self) -> np.dtype:
        """Element type of the bound parameters (the first one found)."""
        for mod in self.modules():
            for local in mod._params:
                return mod.param(local).dtype
        raise ValueError(f"{self.name} has no parameters, so no dtype")

    # -- initialisation and convenience -------------------------------------------------
    def init_parameters(self, seed: int = 0) -> None:
        """Write deterministic initial values into every owned, bound parameter.

        Values depend only on ``(seed, full parameter name)`` and the declared recipe.
        """
        for mod in self.modules():
            for spec in mod._specs.values():
                arr = mod.param(spec.name)
                value = init_value(f"{mod.prefix}{spec.name}", spec.shape, seed, spec.kind,
                                   arr.dtype, scale=spec.scale)
                arr[...] = as_like(arr, value)

    def build(
        self, dtype: np.dtype | type = np.float64, seed: int = 0, *, pad_to: int = 1,
        device: Any = None,
    ) -> tuple[FlatBuffer, FlatBuffer]:
        """Allocate parameter and gradient buffers, bind them and initialise the parameters.

        Returns ``(params, grads)``: two :class:`FlatBuffer` with the layout of
        :meth:`named_parameter_shapes`; the gradient buffer starts at zero. ``device``
        ("cpu", "cuda" or a :class:`~mpidist.core.arrays.Device`) says where they live.
        """
        dt = np.dtype(dtype)
        if dt.kind != "f":
            raise ValueError(f"dtype={dt} must be a floating-point type")
        params = FlatBuffer(self.named_parameter_shapes(), dt, pad_to=pad_to, device=device)
        grads = params.like()
        self.bind(params.views(), grads.views())
        self.init_parameters(seed)
        return params, grads

    def zero_grad(self) -> None:
        """Set every bound gradient array of the tree to zero."""
        for mod in self.modules():
            for g in mod._grads.values():
                if g is not None:
                    g.fill(0)

    def train(self, mode: bool = True) -> Module:
        """Set training mode (dropout active) on the whole tree; returns ``self``."""
        for mod in self.modules():
            mod.__dict__["training"] = bool(mode)
        return self

    def eval(self) -> Module:
        """Set evaluation mode (dropout off) on the whole tree; returns ``self``."""
        return self.train(False)

    def clear_cache(self, ctx: Hashable = None, *, every: bool = True) -> None:
        """Forget the activations kept for backward (and what :meth:`backward_input` kept
        for :meth:`backward_weight`): every context's (e.g. after an evaluation forward), or
        only those of ``ctx`` with ``every=False``."""
        for mod in self.modules():
            if every:
                mod._cache.clear()
                mod._deferred.clear()
            else:
                mod._cache.pop(ctx, None)
                mod._deferred.pop(ctx, None)

    def pending_weight_contexts(self) -> set[Hashable]:
        """The contexts whose :meth:`backward_input` ran somewhere in the tree but whose
        :meth:`backward_weight` has not yet. Not collective."""
        return {ctx for mod in self.modules() for ctx in mod._deferred}

    # -- forward / backward -------------------------------------------------------------
    def forward(self, x: Any, ctx: Hashable = None) -> Any:
        """Compute the output; keep what backward needs under ``ctx``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement forward")

    def backward(self, dy: Any, ctx: Hashable = None) -> Any:
        """Accumulate parameter gradients and return the input gradient for ``ctx``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement backward")

    #: Set by a container whose ``backward`` runs its children's backward in reverse
    #: registration order and nothing else, so the default :meth:`backward_input` (that
    #: chain of the children's ``backward_input``) is right for it.
    _chain_backward: bool = False

    def backward_input(self, dy: Any, ctx: Hashable = None) -> Any:
        """The "B" half of :meth:`backward`: return the input gradient for ``ctx`` and keep
        under ``ctx`` what :meth:`backward_weight` needs (at most the forward's cache plus the
        upstream gradient of the weight products). Writes no gradient buffer. ``dy`` may be
        kept by reference: the caller must not modify it before :meth:`backward_weight`.

        Default: a layer without parameters returns its :meth:`backward` (there is no weight
        half); a container runs its children's ``backward_input`` in reverse registration
        order, if it has no parameters of its own and its ``backward`` is that chain (it does
        not override ``backward``, or sets ``_chain_backward``). Any other module must
        implement the split itself and raises ``NotImplementedError``. Collective where
        :meth:`backward` is (the input-gradient communication of tensor parallelism).
        """
        cls = type(self).__name__
        if self._params:
            raise NotImplementedError(f"{cls} has parameters but does not split its backward "
                                      "(implement backward_input and backward_weight)")
        if not self._children:
            return self.backward(dy, ctx)
        if type(self).backward is not Module.backward and not self._chain_backward:
            raise NotImplementedError(f"{cls}.backward is not a chain of its children's: "
                                      "implement backward_input and backward_weight")
        for child in reversed(self._children.values()):
            dy = child.backward_input(dy, ctx)
        return dy

    def backward_weight(self, ctx: Hashable = None) -> None:
        """The "W" half of :meth:`backward`: accumulate (``+=``) the parameter gradients of
        ``ctx`` from what :meth:`backward_input` kept, and drop it. Reads only gradient
        buffers (the parameters may be unbound by then). Not collective.

        Default: every child's ``backward_weight``, in reverse registration order (the order
        :meth:`backward` reaches them, so that a tied weight's two gradient contributions add
        up in the same order); nothing for a layer without parameters."""
        for child in reversed(self._children.values()):
            child.backward_weight(ctx)

    def __call__(self, x: Any, ctx: Hashable = None) -> Any:
        return self.forward(x, ctx)

    def _save(self, ctx: Hashable, value: Any) -> None:
        self._cache[ctx] = value

    def _take(self, ctx: Hashable) -> Any:
        try:
            return self._cache.pop(ctx)
        except KeyError:
            raise RuntimeError(
                f"{self.name} ({type(self).__name__}): backward with ctx={ctx!r} has no "
                "matching forward (each forward allows one backward)"
            ) from None

    def _defer(self, ctx: Hashable, value: Any) -> None:
        if ctx in self._deferred:
            raise RuntimeError(f"{self.name} ({type(self).__name__}): backward_input with "
                               f"ctx={ctx!r} ran twice without backward_weight in between")
        self._deferred[ctx] = value

    def _take_deferred(self, ctx: Hashable) -> Any:
        try:
            return self._deferred.pop(ctx)
        except KeyError:
            raise RuntimeError(
                f"{self.name} ({type(self).__name__}): backward_weight with ctx={ctx!r} has "
                "no matching backward_input"
            ) from None

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}("]
        for s in self._specs.values():
            lines.append(f"  {s.name}: {s.shape}")
        for local, (owner, owner_name) in self._shared.items():
            lines.append(f"  {local}: tied to {owner.full_name(owner_name)}")
        for cname, child in self._children.items():
            sub = repr(child).replace("\n", "\n  ")
            lines.append(f"  ({cname}): {sub}")
        lines.append(")")
        return "\n".join(lines) if len(lines) > 2 else f"{type(self).__name__}()"


def _lookup(
    arrays: Mapping[str, np.ndarray], full: str, shape: tuple[int, ...], what: str
) -> np.ndarray:
    try:
        arr = arrays[full]
    except KeyError:
        raise ValueError(f"{what} {full!r} is missing from the arrays given to bind") from None
    if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
        raise ValueError(f"{what} {full!r} must be an array, got {type(arr).__name__}")
    if tuple(arr.shape) != shape:
        raise ValueError(f"{what} {full!r} has shape {tuple(arr.shape)}, expected {shape}")
    if not is_floating(arr.dtype):
        raise ValueError(f"{what} {full!r} has dtype {arr.dtype}, expected a float type")
    return arr
