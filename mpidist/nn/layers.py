"""Layers with explicit backward: Linear, Embedding, LayerNorm, activations, Dropout, containers.

Conventions: the last axis is the feature axis; every leading axis is a batch axis. Outputs
have the dtype of the bound parameters (float inputs are cast to it), so a float32 model runs
in float32 end to end. Constants are Python floats so NumPy never promotes float32 arrays.

Arrays are made and combined through the namespace of the bound parameters
(:func:`mpidist.core.arrays.namespace`): NumPy on the CPU, CuPy on a GPU; a host input of a
device model is copied to the device on entry.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator

import numpy as np

from mpidist.core.arrays import as_array, as_like, namespace

from . import fused as F
from .blas import add_transposed_product
from .init import fan_in_bound, init_generator
from .module import Module

__all__ = [
    "GELU",
    "Dense",
    "Dropout",
    "Embedding",
    "Identity",
    "LayerNorm",
    "Linear",
    "ModuleList",
    "ReLU",
    "Sequential",
    "Tanh",
    "check_features",
    "float_input",
    "gelu_tanh",
    "matmul_rows",
]


def positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what}={value!r} must be a positive integer")
    return int(value)


def check_features(x: np.ndarray, n: int, who: str, what: str = "in_features") -> None:
    """Raise ``ValueError`` unless the last axis of ``x`` has length ``n``."""
    if x.ndim < 1 or x.shape[-1] != n:
        raise ValueError(f"{who}: input of shape {x.shape} does not end in {what}={n}")


def float_input(x: object, like: np.ndarray, who: str) -> np.ndarray:
    """``x`` as an array of ``like``'s dtype and library (a host ``x`` is copied to the
    device of a device ``like``); ``ValueError`` naming ``who`` if it is not numeric."""
    arr = as_like(like, x)
    if arr.dtype.kind not in "fiub" and arr.dtype != like.dtype:
        raise ValueError(f"{who}: input dtype {arr.dtype} is not numeric")
    return arr.astype(like.dtype, copy=False)


def check_ids(ids: object, num_embeddings: int, who: str) -> np.ndarray:
    """``ids`` as an integer array; ``ValueError`` naming ``who`` for non-integers or ids
    outside ``[0, num_embeddings)``. Pure."""
    arr = as_array(ids)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{who}: ids must be integers, got dtype {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0:
            raise ValueError(f"{who}: id {lo} is negative")
        if hi >= num_embeddings:
            raise ValueError(f"{who}: id {hi} is out of range for num_embeddings={num_embeddings}")
    return arr


class Linear(Module):
    """``y = x @ weight + bias`` with ``weight`` of shape ``(in_features, out_features)``.

    The (in, out) layout is GPT-2's Conv1D layout: no transpose in forward, and a
    column-parallel split (of ``out_features``) is a split of the last axis.

    Args:
        in_features, out_features: sizes of the last axis of input and output.
        bias: whether to add a bias (initialised to zero).
        init: ``"normal"`` (std ``scale``) or ``"uniform"`` (half-width ``scale``; default
            ``1/sqrt(in_features)`` when ``scale`` is None).
        scale: std or half-width of the weight init; default 0.02 for ``"normal"``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        init: str = "normal",
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.in_features = positive_int(in_features, "in_features")
        self.out_features = positive_int(out_features, "out_features")
        self.has_bias = bool(bias)
        if scale is None:
            scale = 0.02 if init == "normal" else fan_in_bound(self.in_features)
        self.register_parameter("weight", (self.in_features, self.out_features), init, scale)
        if self.has_bias:
            self.register_parameter("bias", (self.out_features,), "zeros", 0.0)

    def forward(self, x: np.ndarray, ctx: Hashable = None, *, add_bias: bool = True,
                keep_input: bool = True) -> np.ndarray:
        """``x @ weight (+ bias)``; ``add_bias=False`` leaves the bias add to the caller (a
        fused activation), which then owes :meth:`backward` the bias gradient too.
        ``keep_input=False`` keeps nothing for backward: the caller recomputes the input and
        calls :meth:`input_grad` and :meth:`accumulate_grad` instead."""
        w = self.param("weight")
        x = float_input(x, w, self.name)
        check_features(x, self.in_features, self.name)
        y = matmul_rows(x, w)
        if self.has_bias and add_bias:
            y += self.param("bias")
        if keep_input:
            self._save(ctx, x)
        return y

    def backward(self, dy: np.ndarray, ctx: Hashable = None, *,
                 bias_grad: bool = True) -> np.ndarray:
        """Input gradient; accumulates the weight gradient, and the bias gradient unless
        ``bias_grad=False`` (the fused activation has accumulated it)."""
        x = self._take(ctx)
        self.accumulate_grad(x, dy, bias_grad=bias_grad)
        return self.input_grad(dy)

    def backward_input(self, dy: np.ndarray, ctx: Hashable = None, *,
                       bias_grad: bool = True) -> np.ndarray:
        """The input gradient (:meth:`input_grad`); keeps the forward's input and ``dy`` for
        :meth:`backward_weight` (with ``bias_grad=False`` that will not add the bias
        gradient, as in :meth:`backward`)."""
        x = self._take(ctx)
        self._check_output_grad(x, dy)
        dx = self.input_grad(dy)
        self.defer_grad(ctx, x, dy, bias_grad=bias_grad)
        return dx

    def defer_grad(self, ctx: Hashable, x: np.ndarray, dy: np.ndarray, *,
                   bias_grad: bool = True) -> None:
        """Keep the input ``x`` and output gradient ``dy`` under ``ctx`` for
        :meth:`backward_weight` (for a caller that did not keep the input in forward and
        computed the input gradient itself). Not collective."""
        self._defer(ctx, (x, dy, bias_grad))

    def backward_weight(self, ctx: Hashable = None) -> None:
        """:meth:`accumulate_grad` from what :meth:`backward_input` (or :meth:`defer_grad`)
        kept under ``ctx``."""
        x, dy, bias_grad = self._take_deferred(ctx)
        self.accumulate_grad(x, dy, bias_grad=bias_grad)
        super().backward_weight(ctx)

    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        """``dy @ weight.T``, the gradient of the input (part of :meth:`backward`)."""
        if dy.shape[-1] != self.out_features:
            raise ValueError(f"{self.name}: output gradient of shape {dy.shape}, expected "
                             f"last axis {self.out_features}")
        return matmul_rows(dy, self.param("weight").T)

    def accumulate_grad(self, x: np.ndarray, dy: np.ndarray, *, bias_grad: bool = True) -> None:
        """Add ``x.T @ dy`` to the weight gradient (and ``dy``'s column sums to the bias
        gradient unless ``bias_grad=False``): the rest of :meth:`backward`, given the input."""
        self._check_output_grad(x, dy)
        x2 = x.reshape(-1, self.in_features)
        dy2 = dy.reshape(-1, self.out_features)
        add_transposed_product(self.grad("weight"), x2, dy2)
        if self.has_bias and bias_grad:
            gb = self.grad("bias")
            gb += dy2.sum(axis=0, dtype=gb.dtype)

    def _check_output_grad(self, x: np.ndarray, dy: np.ndarray) -> None:
        if dy.shape != x.shape[:-1] + (self.out_features,):
            raise ValueError(
                f"{self.name}: output gradient of shape {dy.shape}, expected "
                f"{x.shape[:-1] + (self.out_features,)}"
            )


def matmul_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w`` for ``x`` of any rank: one matrix product over all leading axes (NumPy
    would run one product per leading index, about 6% slower for a (16, 128, C) input).
    Not collective."""
    if x.ndim <= 2:
        return x @ w
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(x.shape[:-1] + (w.shape[-1],))


class Embedding(Module):
    """Lookup table ``weight[ids]`` of shape ``(num_embeddings, embedding_dim)``.

    Inputs are integer ids in ``[0, num_embeddings)``; anything else raises ``ValueError``
    naming the bad value. Backward returns ``None`` (ids have no gradient).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, scale: float = 0.02) -> None:
        super().__init__()
        self.num_embeddings = positive_int(num_embeddings, "num_embeddings")
        self.embedding_dim = positive_int(embedding_dim, "embedding_dim")
        self.register_parameter(
            "weight", (self.num_embeddings, self.embedding_dim), "normal", scale
        )

    def forward(self, ids: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        w = self.param("weight")
        arr = as_like(w, check_ids(ids, self.num_embeddings, self.name))
        self._save(ctx, arr)
        return w[arr]

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> None:
        ids = self._take(ctx)
        self._check_output_grad(ids, dy)
        self._accumulate(ids, dy)

    def backward_input(self, dy: np.ndarray, ctx: Hashable = None) -> None:
        """No input gradient (ids have none): keeps the ids and ``dy`` for
        :meth:`backward_weight`, which does all of :meth:`backward`'s work."""
        ids = self._take(ctx)
        self._check_output_grad(ids, dy)
        self._defer(ctx, (ids, dy))
        return None

    def backward_weight(self, ctx: Hashable = None) -> None:
        self._accumulate(*self._take_deferred(ctx))

    def _accumulate(self, ids: np.ndarray, dy: np.ndarray) -> None:
        F.embedding_backward(self.grad("weight"), ids.reshape(-1),
                             dy.reshape(-1, self.embedding_dim))

    def _check_output_grad(self, ids: np.ndarray, dy: np.ndarray) -> None:
        if dy.shape != ids.shape + (self.embedding_dim,):
            raise ValueError(
                f"{self.name}: output gradient of shape {dy.shape}, expected "
                f"{ids.shape + (self.embedding_dim,)}"
            )


class LayerNorm(Module):
    """Layer normalisation over the last axis; learned ``weight`` (ones) and ``bias`` (zeros)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = positive_int(dim, "dim")
        self.eps = float(eps)
        self.register_parameter("weight", (self.dim,), "ones", 1.0)
        self.register_parameter("bias", (self.dim,), "zeros", 0.0)

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        w = self.param("weight")
        x = float_input(x, w, self.name)
        check_features(x, self.dim, self.name, "dim")
        x2 = x.reshape(-1, self.dim)
        out, mean, rstd = F.layer_norm(x2, w, self.param("bias"), self.eps)
        # The input is kept (not xhat): it is alive anyway as the residual stream.
        self._save(ctx, (x2, mean, rstd))
        return out.reshape(x.shape)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        x2, mean, rstd = self._take(ctx)
        dx = F.layer_norm_backward(dy.reshape(-1, self.dim), x2, self.param("weight"), mean,
                                   rstd, self.grad("weight"), self.grad("bias"))
        return dx.reshape(dy.shape)

    def backward_input(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        """The input gradient. The fused pass that computes it also computes the parameter
        gradients' partial sums (C numbers per row chunk): those are kept, not the inputs,
        and :meth:`backward_weight` adds them up."""
        x2, mean, rstd = self._take(ctx)
        dx, kept = F.layer_norm_backward_input(dy.reshape(-1, self.dim), x2,
                                               self.param("weight"), mean, rstd)
        self._defer(ctx, kept)
        return dx.reshape(dy.shape)

    def backward_weight(self, ctx: Hashable = None) -> None:
        F.layer_norm_backward_weight(self._take_deferred(ctx), self.grad("weight"),
                                     self.grad("bias"))


def gelu_tanh(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GELU with GPT-2's tanh approximation; returns ``(y, tanh_term)`` (backward reuses it)."""
    t = F.tanh_term(x)
    y = t + 1.0
    y *= x
    y *= 0.5
    return y, t


class GELU(Module):
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` — the GPT-2 approximation.

    Keeps only its input for backward (the tanh is recomputed there). With ``bias`` (the
    preceding Linear's, see ``Linear.forward(add_bias=False)``) forward computes
    ``gelu(x + bias)`` in one pass, overwriting ``x`` with ``x + bias``, and backward adds the
    bias gradient into ``bias_grad``.
    """

    def forward(self, x: np.ndarray, ctx: Hashable = None, *,
                bias: np.ndarray | None = None) -> np.ndarray:
        x = as_array(x)
        h = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
        if bias is not None and not namespace(x).shares_memory(h, x):
            raise ValueError(f"{self.name}: a bias needs a contiguous input to add it in place")
        y = F.bias_gelu(h, bias)
        self._save(ctx, h)
        return y.reshape(x.shape)

    def backward(self, dy: np.ndarray, ctx: Hashable = None, *,
                 bias_grad: np.ndarray | None = None, overwrite: bool = False) -> np.ndarray:
        """``dy * gelu'(x)``; ``overwrite=True`` lets it reuse ``dy``'s memory."""
        h = self._take(ctx)
        d = F.bias_gelu_backward(h, dy.reshape(h.shape), bias_grad, inplace=overwrite)
        return d.reshape(dy.shape)

    def backward_output(self, dy: np.ndarray, ctx: Hashable = None, *,
                        bias_grad: np.ndarray | None = None,
                        overwrite: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`backward` that also returns forward's output, recomputed in the same
        pass: ``(dy * gelu'(x), gelu(x))``, for a caller that did not keep the output."""
        h = self._take(ctx)
        d, y = F.bias_gelu_backward(h, dy.reshape(h.shape), bias_grad, inplace=overwrite,
                                    output=True)
        return d.reshape(dy.shape), y.reshape(dy.shape)


class ReLU(Module):
    """``max(x, 0)``."""

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        x = as_array(x)
        mask = x > 0
        self._save(ctx, mask)
        return x * mask

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return dy * self._take(ctx)


class Tanh(Module):
    """``tanh(x)``."""

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        x = as_array(x)
        y = namespace(x).tanh(x)
        self._save(ctx, y)
        return y

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        y = self._take(ctx)
        return dy * (1.0 - y * y)


class Identity(Module):
    """``y = x``."""

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return x

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return dy


class Dropout(Module):
    """Inverted dropout with probability ``p``; identity when ``p == 0`` or in eval mode.

    Masks come from a generator seeded by ``(seed, module name)``, so a run is reproducible:
    the k-th training forward of a given module draws the same mask in every run. Masks are
    drawn per local batch, so with ``p > 0`` results depend on how the global batch is split
    over ranks (models default to ``p = 0``).
    """

    def __init__(self, p: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        if not 0.0 <= float(p) < 1.0:
            raise ValueError(f"dropout p={p} must be in [0, 1)")
        self.p = float(p)
        self.seed = int(seed)
        self._rng: np.random.Generator | None = None

    def reset_rng(self, seed: int | None = None) -> None:
        """Restart the mask sequence (from ``seed`` if given)."""
        if seed is not None:
            self.seed = int(seed)
        self._rng = None

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        x = as_array(x)
        if not self.training or self.p == 0.0:
            self._save(ctx, None)
            return x
        if self._rng is None:
            self._rng = init_generator(f"{self.prefix}dropout", self.seed)
        keep = self._rng.random(x.shape) >= self.p
        mask = as_like(x, keep).astype(x.dtype)
        mask *= 1.0 / (1.0 - self.p)
        self._save(ctx, mask)
        return x * mask

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        mask = self._take(ctx)
        return dy if mask is None else dy * mask


ACTIVATIONS: dict[str, type[Module]] = {"relu": ReLU, "tanh": Tanh, "gelu": GELU}


def make_activation(name: str | None) -> Module | None:
    """A new activation module by name (``None``: no activation); ValueError for a name not
    in :data:`ACTIVATIONS`. Not collective."""
    if name is not None and name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is not one of {sorted(ACTIVATIONS)}")
    return None if name is None else ACTIVATIONS[name]()


class Dense(Linear):
    """``activation(x @ weight + bias)``: one unit of an MLP (parameters ``weight``, ``bias``).

    ``activation`` is ``"relu"``, ``"tanh"``, ``"gelu"`` or ``None``. Weights are uniform in
    ``±1/sqrt(in_features)``, biases zero.
    """

    def __init__(self, in_features: int, out_features: int, activation: str | None = "relu"):
        super().__init__(in_features, out_features, True, init="uniform")
        self._act = make_activation(activation)
        self.activation = activation

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        y = super().forward(x, ctx)
        return y if self._act is None else self._act.forward(y, ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        if self._act is not None:
            dy = self._act.backward(dy, ctx)
        return super().backward(dy, ctx)

    def backward_input(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        if self._act is not None:
            dy = self._act.backward_input(dy, ctx)
        return super().backward_input(dy, ctx)


class ModuleList(Module):
    """An indexable list of submodules (named ``"0"``, ``"1"``, ...) with no forward."""

    def __init__(self, modules: Iterable[Module] = ()) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            if not isinstance(m, Module):
                raise ValueError(
                    f"{type(self).__name__} item {i} is a {type(m).__name__}, not a Module"
                )
            setattr(self, str(i), m)

    def __len__(self) -> int:
        return len(self._children)

    def __getitem__(self, i: int) -> Module:
        return list(self._children.values())[i]

    def __iter__(self) -> Iterator[Module]:
        return iter(self._children.values())

class Sequential(ModuleList):
    """Runs its children in order (named ``"0"``, ``"1"``, ...); backward in reverse."""

    _chain_backward = True

    def __init__(self, *modules: Module) -> None:
        super().__init__(modules)

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        for m in self._children.values():
            x = m.forward(x, ctx)
        return x

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        for m in reversed(self._children.values()):
            dy = m.backward(dy, ctx)
        return dy
