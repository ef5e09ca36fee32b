"""Megatron-style tensor parallelism: the four mappings, the parallel layers, and
:func:`parallelize`, which applies a per-layer plan (:mod:`mpidist.nn.tp_plan`) to a model.

A tensor-parallel group of size T (``comm``, normally ``mesh.group("tp")``) splits each big
matrix of a model over its ranks:

* :class:`ColumnParallelLinear` splits the output features (weight columns, the bias);
* :class:`RowParallelLinear` splits the input features (weight rows) and sums the partial
  outputs with one allreduce; its bias is replicated and added after the sum;
* :class:`VocabParallelEmbedding` and :class:`VocabParallelLMHead` split the vocabulary;
  :class:`VocabParallelCrossEntropy` computes the loss from vocabulary-sharded logits;
* attention runs its local heads (the ``"heads"`` style): q, k and v columns of those heads
  column parallel, the output projection row parallel; an MLP is column → row parallel.

:func:`parallelize` builds the tensor-parallel form of a single-process model from a plan
(``{"blocks.*.attn.qkv": ColwiseParallel(groups=3), "blocks.*.mlp.fc": "colwise", ...}``);
:func:`TensorParallelGPT` is ``parallelize(GPT(config), GPT_PLAN, comm=comm)``.

Communication happens only in the four mappings of :mod:`mpidist.nn.tp_mappings` (design
idea 8: copy, reduce, gather, scatter, each with its forward and backward side by side).

Parameters keep the single-process names (``"blocks.0.attn.qkv.weight"``); each rank holds
a slice of the global tensor, recorded as a :class:`TPPartition` (see :func:`tp_partition`),
and initialised to exactly that slice of the single-process initial value. A checkpoint can
therefore write every tp rank's piece as a hyperslab of one global dataset.

Every forward and backward below is collective over the tp group (all its ranks must run
the same layers on equally shaped inputs). A group of size 1 (or ``comm=None``) makes no MPI
call, so the layers equal the single-process ones. The split backward
(``backward_input``/``backward_weight``, see :class:`~mpidist.nn.Module`) communicates only in
``backward_input``, where the input gradient needs it; ``backward_weight`` is local.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np

from mpidist.core import collectives as C
from mpidist.core.arrays import as_array, as_like, namespace

from . import fused as F
from .init import fan_in_bound, init_value
from .layers import Embedding, Linear, check_ids, make_activation, matmul_rows
from .losses import check_targets, resolve_normalizer
from .models import GPT, GPTConfig
from .module import Module
from .tp_mappings import (
    CopyToTensorParallel,
    GatherFromTensorParallel,
    ReduceFromTensorParallel,
    ScatterToTensorParallel,
)
from .tp_mappings import even_split as _split
from .tp_mappings import tp_group as _group
from .tp_plan import (
    GPT_PLAN,
    ColwiseParallel,
    HeadParallel,
    Plan,
    RowwiseParallel,
    Style,
    VocabParallel,
    check_plan,
    default_plan,
)

__all__ = [
    "GPT_PLAN",
    "ColumnParallelLinear",
    "ColwiseParallel",
    "CopyToTensorParallel",
    "GatherFromTensorParallel",
    "HeadParallel",
    "Plan",
    "ReduceFromTensorParallel",
    "RowParallelLinear",
    "RowwiseParallel",
    "ScatterToTensorParallel",
    "Style",
    "TPPartition",
    "TensorParallelGPT",
    "TensorParallelModule",
    "VocabParallel",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "check_plan",
    "default_plan",
    "parallelize",
    "tp_partition",
    "tp_partitions",
]


# -- partitions ---------------------------------------------------------------------------
class TPPartition(NamedTuple):
    """Which slice of a global tensor a tp rank holds.

    Along ``axis`` the global tensor is viewed as ``groups`` equal consecutive blocks and
    the rank holds ``[start, stop)`` of every block (``groups == 1``: one contiguous range).
    ``groups == 3`` describes the fused q|k|v projection, where a rank holds the columns of
    its heads in each of q, k and v. Slices are uniform: tp rank r holds
    ``[r * w, (r + 1) * w)`` with ``w = stop - start`` (see :meth:`for_rank`).
    """

    axis: int
    start: int
    stop: int
    groups: int = 1

    @property
    def width(self) -> int:
        return self.stop - self.start

    def for_rank(self, rank: int) -> TPPartition:
        """The partition tp rank ``rank`` holds (same axis, width and groups)."""
        w = self.width
        return TPPartition(self.axis, rank * w, (rank + 1) * w, self.groups)

    def local_shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(full_shape)
        shape[self.axis] = self.width * self.groups
        return tuple(shape)

    def ranges(self, full_shape: tuple[int, ...]) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` ranges of the global ``axis`` this rank holds (one per block),
        in the order they sit in the local tensor — the hyperslabs a checkpoint writes."""
        block = full_shape[self.axis] // self.groups
        return [(g * block + self.start, g * block + self.stop) for g in range(self.groups)]

    def index(self, full_shape: tuple[int, ...]) -> tuple[Any, ...]:
        """An index into the global tensor selecting this rank's slice (get or set)."""
        idx: list[Any] = [slice(None)] * len(full_shape)
        rs = self.ranges(full_shape)
        if len(rs) == 1:
            idx[self.axis] = slice(*rs[0])
        else:
            idx[self.axis] = np.concatenate([np.arange(lo, hi) for lo, hi in rs])
        return tuple(idx)

    def take(self, full: np.ndarray) -> np.ndarray:
        """This rank's slice of a global tensor (a contiguous copy)."""
        return np.ascontiguousarray(full[self.index(full.shape)])


class TensorParallelModule(Module):
    """A module whose tree may hold tp-sharded parameters.

    ``init_parameters`` writes each sharded parameter's slice of the single-process initial
    value (so the tp model starts exactly where the single-process model starts); plain
    parameters are initialised as usual.
    """

    def split_parameter(self, name: str, full_shape: tuple[int, ...],
                        part: TPPartition) -> None:
        """Declare this module's registered parameter ``name`` the ``part`` slice of a global
        tensor of ``full_shape`` (its registered shape is ``part.local_shape(full_shape)``)."""
        full_shape = tuple(int(s) for s in full_shape)
        parts = self.__dict__.setdefault("_tp_parts", {})
        parts[name] = (part, full_shape)

    def init_parameters(self, seed: int = 0) -> None:
        for mod in self.modules():
            parts = mod.__dict__.get("_tp_parts", {})
            for spec in mod.own_parameter_specs():
                arr = mod.param(spec.name)
                part, full_shape = parts.get(spec.name, (None, spec.shape))
                full = init_value(f"{mod.prefix}{spec.name}", full_shape, seed, spec.kind,
                                  arr.dtype, scale=spec.scale)
                arr[...] = as_like(arr, full if part is None else part.take(full))

    def tp_partition(self, name: str) -> TPPartition | None:
        """This rank's slice of parameter ``name`` (full dotted name), or None if replicated."""
        return tp_partition(self, name)

    def loss(self) -> VocabParallelCrossEntropy:
        """The cross-entropy of this tree's vocabulary-sharded logits (those of its
        :class:`VocabParallelLMHead`); ValueError when it has none. Not collective."""
        heads = [m for m in self.modules() if isinstance(m, VocabParallelLMHead)]
        if not heads:
            raise ValueError(f"{type(self).__name__} has no vocab-parallel head: its output is "
                             "not vocabulary-sharded, so any ordinary loss applies")
        return VocabParallelCrossEntropy(heads[-1].comm, heads[-1].vocab_size)


def tp_partitions(module: Module) -> dict[str, tuple[TPPartition, tuple[int, ...]]]:
    """``{full name: (partition, global shape)}`` of every tp-sharded parameter of the tree."""
    out: dict[str, tuple[TPPartition, tuple[int, ...]]] = {}
    for mod in module.modules():
        for local, entry in mod.__dict__.get("_tp_parts", {}).items():
            out[f"{mod.prefix}{local}"] = entry
    return out


def tp_partition(module: Module, name: str) -> TPPartition | None:
    """``(axis, start, stop, groups)`` of parameter ``name`` on this rank, or None when the
    parameter is replicated over tp (or the module is not tensor parallel). Pure."""
    entry = tp_partitions(module).get(name)
    return None if entry is None else entry[0]


# -- parallel layers ------------------------------------------------------------------------
def _no_deferred_bias(layer: Linear, add_bias: bool, more: bool) -> None:
    if not add_bias and more:
        raise ValueError(f"{layer.name}: add_bias=False leaves the bias to the caller, which "
                         "cannot add it before this layer's activation or gather")


class ColumnParallelLinear(Linear, TensorParallelModule):
    """``y = act(x @ weight + bias)`` with the output features split over tp.

    The global weight is ``(in_features, full_out_features)`` (the :class:`Linear` layout);
    rank r holds its columns (``groups > 1``: its columns of each of ``groups`` equal blocks,
    e.g. q|k|v) and its bias entries, so as a :class:`Linear` (``forward(add_bias=,
    keep_input=)``, ``input_grad``, ``accumulate_grad``) this rank's ``out_features`` is its
    slice. The input passes through :class:`CopyToTensorParallel` (``input_grad`` sums the
    input gradient over tp); ``activation`` (a :class:`Dense`'s) is applied to the slice;
    with ``gather_output`` the output is allgathered, else each rank returns its slice.
    ``init``/``scale`` are the single-process layer's (the uniform default uses the global
    fan-in).
    """

    def __init__(self, in_features: int, out_features: int, *, comm: Any, bias: bool = True,
                 gather_output: bool = False, groups: int = 1, init: str = "normal",
                 scale: float | None = None, activation: str | None = None) -> None:
        size, rank = _group(comm)
        if out_features % (groups * size):
            raise ValueError(f"tp={size} does not divide out_features={out_features}"
                             + (f" / {groups} blocks" if groups > 1 else ""))
        lo, hi = _split(out_features // groups, size, rank, "out_features per block")
        super().__init__(in_features, (hi - lo) * groups, bias, init=init, scale=scale)
        self.full_out_features = int(out_features)
        self.copy_in = CopyToTensorParallel(comm)
        self.act = make_activation(activation)
        self.gather = GatherFromTensorParallel(comm) if gather_output else None
        self.split_parameter("weight", (self.in_features, out_features),
                             TPPartition(1, lo, hi, groups))
        if self.has_bias:
            self.split_parameter("bias", (out_features,), TPPartition(0, lo, hi, groups))

    def forward(self, x: np.ndarray, ctx: Hashable = None, *, add_bias: bool = True,
                keep_input: bool = True) -> np.ndarray:
        _no_deferred_bias(self, add_bias, self.act is not None or self.gather is not None)
        y = super().forward(self.copy_in.forward(x, ctx), ctx, add_bias=add_bias,
                            keep_input=keep_input)
        if self.act is not None:
            y = self.act.forward(y, ctx)
        return y if self.gather is None else self.gather.forward(y, ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None, *,
                 bias_grad: bool = True) -> np.ndarray:
        if self.gather is not None:
            dy = self.gather.backward(dy, ctx)
        if self.act is not None:
            dy = self.act.backward(dy, ctx)
        return super().backward(dy, ctx, bias_grad=bias_grad)

    def backward_input(self, dy: np.ndarray, ctx: Hashable = None, *,
                       bias_grad: bool = True) -> np.ndarray:
        if self.gather is not None:
            dy = self.gather.backward_input(dy, ctx)
        if self.act is not None:
            dy = self.act.backward_input(dy, ctx)
        return super().backward_input(dy, ctx, bias_grad=bias_grad)

    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        """The whole input's gradient: this rank's part summed over tp (collective)."""
        return self.copy_in.backward(super().input_grad(dy))


class RowParallelLinear(Linear, TensorParallelModule):
    """``y = act(x @ weight + bias)`` with the input features split over tp.

    Rank r holds its rows of the global ``(full_in_features, out_features)`` weight (as a
    :class:`Linear`, this rank's ``in_features`` is its slice); partial products are summed
    by :class:`ReduceFromTensorParallel`, then the (replicated) bias is added and
    ``activation`` applied, so the bias gradient is the same on every tp rank. With
    ``input_is_parallel=False`` the full input is split first (:class:`ScatterToTensorParallel`).
    """

    def __init__(self, in_features: int, out_features: int, *, comm: Any, bias: bool = True,
                 input_is_parallel: bool = True, init: str = "normal",
                 scale: float | None = None, activation: str | None = None) -> None:
        size, rank = _group(comm)
        lo, hi = _split(in_features, size, rank, "in_features")
        if scale is None:
            scale = 0.02 if init == "normal" else fan_in_bound(in_features)
        super().__init__(hi - lo, out_features, bias, init=init, scale=scale)
        self.full_in_features = int(in_features)
        self.scatter = None if input_is_parallel else ScatterToTensorParallel(comm)
        self.reduce_out = ReduceFromTensorParallel(comm)
        self.act = make_activation(activation)
        self.split_parameter("weight", (in_features, self.out_features), TPPartition(0, lo, hi))

    def forward(self, x: np.ndarray, ctx: Hashable = None, *, add_bias: bool = True,
                keep_input: bool = True) -> np.ndarray:
        _no_deferred_bias(self, add_bias, self.act is not None)
        if self.scatter is not None:
            x = self.scatter.forward(as_array(x), ctx)
        y = super().forward(x, ctx, add_bias=False, keep_input=keep_input)
        y = self.reduce_out.forward(y, ctx)
        if self.has_bias and add_bias:
            y += self.param("bias")
        return y if self.act is None else self.act.forward(y, ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None, *,
                 bias_grad: bool = True) -> np.ndarray:
        if self.act is not None:
            dy = self.act.backward(dy, ctx)
        return super().backward(self.reduce_out.backward(dy, ctx), ctx, bias_grad=bias_grad)

    def backward_input(self, dy: np.ndarray, ctx: Hashable = None, *,
                       bias_grad: bool = True) -> np.ndarray:
        if self.act is not None:
            dy = self.act.backward_input(dy, ctx)
        return super().backward_input(self.reduce_out.backward_input(dy, ctx), ctx,
                                      bias_grad=bias_grad)

    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        """This rank's slice of the input gradient (the whole one, allgathered, when the
        layer split its input itself)."""
        dx = super().input_grad(dy)
        return dx if self.scatter is None else self.scatter.backward(dx)


class VocabParallelEmbedding(TensorParallelModule):
    """Embedding table split by rows (token ids) over tp; partial lookups are summed.

    Rank r holds rows ``[r V/T, (r+1) V/T)``; ids outside its range look up zeros, and
    :class:`ReduceFromTensorParallel` sums the ranks' results. Backward returns None.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, comm: Any,
                 scale: float = 0.02) -> None:
        super().__init__()
        size, rank = _group(comm)
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.lo, self.hi = _split(self.num_embeddings, size, rank, "vocab_size")
        self.reduce_out = ReduceFromTensorParallel(comm)
        self.register_parameter("weight", (self.hi - self.lo, self.embedding_dim), "normal",
                                scale)
        self.split_parameter("weight", (self.num_embeddings, self.embedding_dim),
                             TPPartition(0, self.lo, self.hi))

    def forward(self, ids: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        w = self.param("weight")
        arr = as_like(w, check_ids(ids, self.num_embeddings, self.name))
        mine = (arr >= self.lo) & (arr < self.hi)
        local = namespace(w).where(mine, arr - self.lo, 0)
        y = w[local]
        y[~mine] = 0
        self._save(ctx, (local, mine))
        return self.reduce_out.forward(y, ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> None:
        local, mine = self._take(ctx)
        self._accumulate(local, mine, self.reduce_out.backward(dy, ctx))
        return None

    def backward_input(self, dy: np.ndarray, ctx: Hashable = None) -> None:
        """No input gradient (ids have none): keeps the ids and ``dy`` for
        :meth:`backward_weight`, which does all of :meth:`backward`'s work."""
        local, mine = self._take(ctx)
        self._defer(ctx, (local, mine, self.reduce_out.backward_input(dy, ctx)))
        return None

    def backward_weight(self, ctx: Hashable = None) -> None:
        self._accumulate(*self._take_deferred(ctx))
        super().backward_weight(ctx)

    def _accumulate(self, local: np.ndarray, mine: np.ndarray, dy: np.ndarray) -> None:
        # Rows of ids this rank does not hold add zeros to row 0.
        F.embedding_backward(self.grad("weight"), local.reshape(-1),
                             dy.reshape(-1, self.embedding_dim) * mine.reshape(-1, 1))


class VocabParallelLMHead(TensorParallelModule):
    """``logits = x @ weight.T`` with the ``(vocab_size, n_embd)`` weight split by rows:
    each rank returns its vocabulary slice of the logits (feed them to
    :class:`VocabParallelCrossEntropy`). With ``tied_to`` the weight is that
    :class:`VocabParallelEmbedding`'s (same rows on every rank)."""

    def __init__(self, n_embd: int, vocab_size: int, *, comm: Any,
                 tied_to: VocabParallelEmbedding | None = None, scale: float = 0.02) -> None:
        super().__init__()
        size, rank = _group(comm)
        self.comm = comm
        self.n_embd, self.vocab_size = int(n_embd), int(vocab_size)
        lo, hi = _split(self.vocab_size, size, rank, "vocab_size")
        self.local_vocab = hi - lo
        self.copy_in = CopyToTensorParallel(comm)
        if tied_to is None:
            self.register_parameter("weight", (self.local_vocab, self.n_embd), "normal", scale)
            self.split_parameter("weight", (self.vocab_size, self.n_embd), TPPartition(0, lo, hi))
        else:
            self.register_shared("weight", tied_to, "weight")

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        w = self.param("weight")
        if x.shape[-1] != self.n_embd:
            raise ValueError(f"{self.name}: input of shape {x.shape} does not end in {self.n_embd}")
        x = self.copy_in.forward(x, ctx)
        self._save(ctx, x)
        return matmul_rows(x, w.T)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        x = self._take(ctx)
        self._accumulate(x, dy)
        return self.copy_in.backward(matmul_rows(dy, self.param("weight")), ctx)

    def backward_input(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        """The input gradient (summed over tp); keeps the input and ``dy`` for
        :meth:`backward_weight`."""
        x = self._take(ctx)
        dx = self.copy_in.backward_input(matmul_rows(dy, self.param("weight")), ctx)
        self._defer(ctx, (x, dy))
        return dx

    def backward_weight(self, ctx: Hashable = None) -> None:
        self._accumulate(*self._take_deferred(ctx))
        super().backward_weight(ctx)

    def _accumulate(self, x: np.ndarray, dy: np.ndarray) -> None:
        self.grad("weight")[...] += (dy.reshape(-1, self.local_vocab).T
                                     @ x.reshape(-1, self.n_embd))


class VocabParallelCrossEntropy(Module):
    """Softmax cross-entropy from vocabulary-sharded logits, without gathering them.

    Same interface and value as :class:`~mpidist.nn.CrossEntropyLoss` (``forward(logits,
    targets, normalizer=None, ctx=None) -> float``, ``backward(dy=1, ctx=None)``), where
    ``logits`` is this rank's slice ``[r V/T, (r+1) V/T)`` of the vocabulary. Forward makes
    two allreduces over tp (the max, then the sum of exponentials and target logits);
    every tp rank returns the same loss. Backward makes no communication.
    """

    def __init__(self, comm: Any, vocab_size: int) -> None:
        super().__init__()
        self.comm = comm
        self.vocab_size = int(vocab_size)
        size, rank = _group(comm)
        self.lo, self.hi = _split(self.vocab_size, size, rank, "vocab_size")

    def forward(self, logits: np.ndarray, targets: np.ndarray,  # type: ignore[override]
                normalizer: float | None = None, ctx: Hashable = None) -> float:
        logits = as_array(logits)
        xp = namespace(logits)
        vl = self.hi - self.lo
        if logits.dtype.kind != "f" or logits.shape[-1:] != (vl,):
            raise ValueError(f"logits of shape {logits.shape} are not this rank's {vl} classes")
        targets = check_targets(targets, logits.shape, self.vocab_size)
        norm = resolve_normalizer(normalizer, targets.size)
        z = logits.reshape(-1, vl)
        if z.dtype.itemsize == 2:  # 16-bit logits (mixed precision): the softmax in float32
            z = z.astype(np.float32)
        m = z.max(axis=-1)
        C.allreduce(m, "max", comm=self.comm)
        z = z - m[:, None]
        p = xp.exp(z)
        t = as_like(z, targets.reshape(-1)) - self.lo
        mine = (t >= 0) & (t < vl)
        tl = xp.where(mine, t, 0)
        rows = xp.arange(t.size)
        sums = xp.stack([p.sum(axis=-1), xp.where(mine, z[rows, tl], 0.0)])
        C.allreduce(sums, "sum", comm=self.comm)
        s, zt = sums[0], sums[1]
        nll = xp.log(s) - zt
        p /= s[:, None]
        self._save(ctx, (p, tl, mine, norm, logits.shape, logits.dtype))
        return float(xp.sum(nll, dtype=np.float64)) / norm

    def backward(self, dy: float = 1.0, ctx: Hashable = None) -> np.ndarray:  # type: ignore[override]
        p, tl, mine, norm, shape, dtype = self._take(ctx)
        rows = namespace(p).arange(tl.size)
        p[rows[mine], tl[mine]] -= 1.0
        p *= float(dy) / norm
        return p.reshape(shape).astype(dtype, copy=False)


# -- applying a plan ------------------------------------------------------------------------
def _parallel_layer(layer: Module, style: Style, comm: Any,
                    built: dict[str, Module]) -> Module | None:
    """The tensor-parallel replacement of ``layer`` under ``style`` (None: adjusted in place).
    A tied head reuses its embedding's replacement from ``built``."""
    specs = {s.name: s for s in layer.own_parameter_specs()}
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        kw = dict(comm=comm, bias=layer.has_bias, init=specs["weight"].kind,
                  scale=specs["weight"].scale, activation=getattr(layer, "activation", None))
        if isinstance(style, ColwiseParallel):
            return ColumnParallelLinear(layer.in_features, layer.out_features, groups=style.groups,
                                        gather_output=style.gather_output, **kw)
        return RowParallelLinear(layer.in_features, layer.out_features,
                                 input_is_parallel=style.input_is_parallel, **kw)
    if isinstance(style, VocabParallel):
        if isinstance(layer, Embedding):
            return VocabParallelEmbedding(layer.num_embeddings, layer.embedding_dim, comm=comm,
                                          scale=specs["weight"].scale)
        owner = layer.full_name("weight").rpartition(".")[0]
        if owner != layer.name:  # tied: check_plan made the owner vocab-parallel too
            return VocabParallelLMHead(layer.n_embd, layer.vocab_size, comm=comm,
                                       tied_to=built[owner])
        return VocabParallelLMHead(layer.n_embd, layer.vocab_size, comm=comm,
                                   scale=specs["weight"].scale)
    return None


@functools.cache
def _tp_class(cls: type) -> type:
    """``cls`` with :class:`TensorParallelModule` mixed in (as FSDP2's ``fully_shard`` does),
    so a container of split layers initialises their slices."""
    return type(f"TP{cls.__name__}", (cls, TensorParallelModule),
                {"__module__": __name__, "__doc__": f"A {cls.__name__} holding tensor-parallel "
                 "layers (made by :func:`parallelize`)."})


def _submodule(root: Module, path: str) -> Module:
    return functools.reduce(getattr, path.split("."), root) if path else root


def parallelize(module: Module, plan: Plan, *, comm: Any) -> Module:
    """The tensor-parallel form of ``module`` for this rank of ``comm`` under ``plan``.

    ``plan`` maps layer-name patterns to styles (see :mod:`mpidist.nn.tp_plan`;
    :func:`default_plan` gives a GPT's or an MLP's). The result is a fresh copy of the tree
    (``module`` is left as it was, still usable), unbound, with each matched layer replaced
    by its parallel form (or, for ``"heads"``, running its local heads). Parameter names are
    the single-process ones, initial values this rank's slices of the single-process ones
    (:meth:`~mpidist.nn.Module.build` or ``init_parameters`` on any sub-tree), and
    :func:`tp_partitions` lists every split tensor. Containers of split layers become
    subclasses of their class and :class:`TensorParallelModule` (``TPGPT``, ``TPBlock``...).
    A vocab-parallel head returns vocabulary-sharded logits: use the result's ``loss()``.

    The plan is checked first (:func:`check_plan`, ValueError on every rank alike); building
    makes no communication. The result's forward and backward are collective over ``comm``;
    it does not check that the styles chain correctly (a colwise layer's split output must
    feed a rowwise layer or a layer that works on slices).
    """
    if tp_partitions(module):
        raise ValueError(f"the {type(module).__name__} is already tensor parallel")
    size, _ = _group(comm)
    styles = check_plan(module, plan, size)
    layers = dict(module.named_modules())
    built: dict[str, Module] = {}
    # Embeddings first: a head tied to one reuses its replacement.
    for path in sorted(styles, key=lambda p: not isinstance(layers[p], Embedding)):
        new = _parallel_layer(layers[path], styles[path], comm, built)
        if new is not None:
            built[path] = new
    # Copying with the replacements in the memo swaps them in wherever the old layers were
    # referenced (children, a model's units list, ...).
    out = copy.deepcopy(module, {id(layers[p]): m for p, m in built.items()})
    out.unbind()
    out.clear_cache()
    for path, new in built.items():
        parent, _, attr = path.rpartition(".")
        setattr(_submodule(out, parent), attr, new)  # gives it its dotted prefix
    for path, style in styles.items():
        if isinstance(style, HeadParallel):
            attn = _submodule(out, path)
            attn.n_head //= size
    inner = [m.prefix for m in out.modules() if isinstance(m, TensorParallelModule)]
    for mod in out.modules():
        if not isinstance(mod, TensorParallelModule) and any(p.startswith(mod.prefix)
                                                             for p in inner):
            mod.__class__ = _tp_class(type(mod))
    return out


def TensorParallelGPT(config: GPTConfig, *, comm: Any) -> Module:
    """The tensor-parallel :class:`~mpidist.nn.GPT` for this tp rank:
    ``parallelize(GPT(config), GPT_PLAN, comm=comm)``.

    Same units (``embed``, ``blocks.i``, ``final``), parameter names and (sliced) initial
    values as the single-process model; ``forward(idx)`` returns this rank's vocabulary slice
    of the logits, and ``loss()`` the matching :class:`VocabParallelCrossEntropy`.
    Building is not collective; forward and backward are, over ``comm``.
    """
    return parallelize(GPT(config), GPT_PLAN, comm=comm)
