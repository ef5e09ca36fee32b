"""Megatron-style tensor parallelism: the four mappings, the parallel layers, and a TP GPT.

A tensor-parallel group of size T (``comm``, normally ``mesh.group("tp")``) splits each big
matrix of a transformer over its ranks:

* :class:`ColumnParallelLinear` splits the output features (weight columns, the bias);
* :class:`RowParallelLinear` splits the input features (weight rows) and sums the partial
  outputs with one allreduce; its bias is replicated and added after the sum;
* :class:`VocabParallelEmbedding` and :class:`VocabParallelLMHead` split the vocabulary;
  :class:`VocabParallelCrossEntropy` computes the loss from vocabulary-sharded logits;
* attention splits its heads (q, k and v columns of the local heads; the output projection
  is row parallel) and the MLP is column → row parallel.

Communication happens only in the four mappings (design idea 8), each one class with its
forward and backward side by side:

=========================  ==================  ==================
mapping                    forward             backward
=========================  ==================  ==================
:class:`CopyToTensorParallel`      identity            allreduce
:class:`ReduceFromTensorParallel`  allreduce           identity
:class:`GatherFromTensorParallel`  allgather (last axis)  split
:class:`ScatterToTensorParallel`   split (last axis)   allgather
=========================  ==================  ==================

Parameters keep the single-process names (``"blocks.0.attn.qkv.weight"``); each rank holds
a slice of the global tensor, recorded as a :class:`TPPartition` (see :func:`tp_partition`),
and initialised to exactly that slice of the single-process initial value. A checkpoint can
therefore write every tp rank's piece as a hyperslab of one global dataset.

Every forward and backward below is collective over the tp group (all its ranks must run
the same layers on equally shaped inputs). A group of size 1 (or ``comm=None``) makes no MPI
call, so the layers equal the single-process ones.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np

from mpidist import collectives as C

from .attention import causal_attention, causal_attention_backward, residual_scale
from .blas import add_transposed_product
from .init import init_value
from .layers import (
    GELU,
    Dropout,
    Embedding,
    LayerNorm,
    ModuleList,
    check_features,
    float_input,
    matmul_rows,
)
from .models import GPTConfig, GPTEmbedding
from .module import Module

__all__ = [
    "ColumnParallelLinear",
    "CopyToTensorParallel",
    "GatherFromTensorParallel",
    "ReduceFromTensorParallel",
    "RowParallelLinear",
    "ScatterToTensorParallel",
    "TPBlock",
    "TPCausalSelfAttention",
    "TPFeedForward",
    "TPGPTEmbedding",
    "TPGPTHead",
    "TPPartition",
    "TensorParallelGPT",
    "TensorParallelModule",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "check_tensor_parallel_gpt",
    "tp_partition",
    "tp_partitions",
]


def _group(comm: Any) -> tuple[int, int]:
    """(size, rank) of a tp communicator; None is a group of one."""
    if comm is None:
        return 1, 0
    return comm.Get_size(), comm.Get_rank()


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


def _split(n: int, size: int, rank: int, what: str) -> tuple[int, int]:
    if n % size:
        raise ValueError(f"tp={size} does not divide {what}={n}")
    w = n // size
    return rank * w, (rank + 1) * w


class TensorParallelModule(Module):
    """A module whose tree may hold tp-sharded parameters.

    ``init_parameters`` writes each sharded parameter's slice of the single-process initial
    value (so the tp model starts exactly where the single-process model starts); plain
    parameters are initialised as usual.
    """

    def register_tp_parameter(self, name: str, full_shape: tuple[int, ...],
                              part: TPPartition | None, kind: str = "normal",
                              scale: float = 0.02) -> None:
        """Declare parameter ``name`` whose global shape is ``full_shape``; with ``part`` the
        rank holds that slice (local shape ``part.local_shape(full_shape)``)."""
        full_shape = tuple(int(s) for s in full_shape)
        shape = full_shape if part is None else part.local_shape(full_shape)
        self.register_parameter(name, shape, kind, scale)
        if part is not None:
            parts = self.__dict__.setdefault("_tp_parts", {})
            parts[name] = (part, full_shape)

    def init_parameters(self, seed: int = 0) -> None:
        for mod in self.modules():
            parts = mod.__dict__.get("_tp_parts", {})
            for spec in mod.own_parameter_specs():
                arr = mod.param(spec.name)
                name = f"{mod.prefix}{spec.name}"
                if spec.name in parts:
                    part, full_shape = parts[spec.name]
                    full = init_value(name, full_shape, seed, spec.kind, arr.dtype,
                                      scale=spec.scale)
                    arr[...] = part.take(full)
                else:
                    arr[...] = init_value(name, spec.shape, seed, spec.kind, arr.dtype,
                                          scale=spec.scale)

    def tp_partition(self, name: str) -> TPPartition | None:
        """This rank's slice of parameter ``name`` (full dotted name), or None if replicated."""
        return tp_partition(self, name)


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


# -- the four mappings ----------------------------------------------------------------------
def _allreduce_copy(x: np.ndarray, comm: Any) -> np.ndarray:
    out = np.array(x, copy=True, order="C")
    C.allreduce(out, "sum", comm=comm)
    return out


def _split_last(x: np.ndarray, comm: Any) -> np.ndarray:
    size, rank = _group(comm)
    if size == 1:
        return x
    lo, hi = _split(x.shape[-1], size, rank, "last dim")
    return np.ascontiguousarray(x[..., lo:hi])


def _gather_last(x: np.ndarray, comm: Any) -> np.ndarray:
    size, _ = _group(comm)
    if size == 1:
        return x
    x = np.ascontiguousarray(x)
    g = C.allgather(x.reshape(-1), comm=comm).reshape((size, *x.shape))
    return np.concatenate(list(g), axis=-1)


class _Mapping(Module):
    """A parameterless module that moves tensors between the tp ranks."""

    def __init__(self, comm: Any) -> None:
        super().__init__()
        self.comm = comm


class CopyToTensorParallel(_Mapping):
    """Enter a tp region: forward is the identity (every rank has the whole input);
    backward allreduces (sums) the partial input gradients. Backward is collective over tp."""

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return x

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return _allreduce_copy(dy, self.comm)


class ReduceFromTensorParallel(_Mapping):
    """Leave a tp region by summing partial outputs: forward allreduces, backward is the
    identity (the gradient of a sum reaches every term). Forward is collective over tp."""

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return _allreduce_copy(x, self.comm)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return dy


class GatherFromTensorParallel(_Mapping):
    """Leave a tp region by concatenating shards of the last axis: forward allgathers,
    backward keeps this rank's slice of the gradient. Forward is collective over tp."""

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return _gather_last(x, self.comm)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return _split_last(dy, self.comm)


class ScatterToTensorParallel(_Mapping):
    """Enter a tp region by splitting the last axis: forward keeps this rank's slice,
    backward allgathers the gradient slices. Backward is collective over tp."""

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return _split_last(x, self.comm)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return _gather_last(dy, self.comm)


# -- parallel layers ------------------------------------------------------------------------
class ColumnParallelLinear(TensorParallelModule):
    """``y = x @ weight + bias`` with the output features split over tp.

    The global weight is ``(in_features, out_features)`` (the :class:`~mpidist.nn.Linear`
    layout); rank r holds its columns (``groups > 1``: its columns of each of ``groups``
    equal blocks, e.g. q|k|v) and its bias entries. The input passes through
    :class:`CopyToTensorParallel`; with ``gather_output`` the output is allgathered, else
    each rank returns its slice of the output features.
    """

    def __init__(self, in_features: int, out_features: int, *, comm: Any, bias: bool = True,
                 gather_output: bool = False, groups: int = 1, scale: float = 0.02) -> None:
        super().__init__()
        size, rank = _group(comm)
        self.in_features, self.out_features = int(in_features), int(out_features)
        if out_features % (groups * size):
            raise ValueError(f"tp={size} does not divide out_features={out_features}"
                             + (f" / {groups} blocks" if groups > 1 else ""))
        lo, hi = _split(out_features // groups, size, rank, "out_features per block")
        self.local_out = (hi - lo) * groups
        self.has_bias = bool(bias)
        self.copy_in = CopyToTensorParallel(comm)
        self.gather = GatherFromTensorParallel(comm) if gather_output else None
        self.register_tp_parameter("weight", (self.in_features, self.out_features),
                                   TPPartition(1, lo, hi, groups), "normal", scale)
        if self.has_bias:
            self.register_tp_parameter("bias", (self.out_features,),
                                       TPPartition(0, lo, hi, groups), "zeros", 0.0)

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        w = self.param("weight")
        x = float_input(x, w.dtype, self.name)
        check_features(x, self.in_features, self.name)
        x = self.copy_in.forward(x, ctx)
        y = matmul_rows(x, w)
        if self.has_bias:
            y += self.param("bias")
        self._save(ctx, x)
        return y if self.gather is None else self.gather.forward(y, ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        if self.gather is not None:
            dy = self.gather.backward(dy, ctx)
        x = self._take(ctx)
        w = self.param("weight")
        x2 = x.reshape(-1, self.in_features)
        dy2 = dy.reshape(-1, self.local_out)
        add_transposed_product(self.grad("weight"), x2, dy2)
        if self.has_bias:
            self.grad("bias")[...] += dy2.sum(axis=0)
        return self.copy_in.backward(matmul_rows(dy, w.T), ctx)


class RowParallelLinear(TensorParallelModule):
    """``y = x @ weight + bias`` with the input features split over tp.

    Rank r holds its rows of the global ``(in_features, out_features)`` weight; partial
    products are summed by :class:`ReduceFromTensorParallel` and the (replicated) bias is
    added after the sum, so its gradient is the same on every tp rank. With
    ``input_is_parallel=False`` the full input is split first (:class:`ScatterToTensorParallel`).
    """

    def __init__(self, in_features: int, out_features: int, *, comm: Any, bias: bool = True,
                 input_is_parallel: bool = True, scale: float = 0.02) -> None:
        super().__init__()
        size, rank = _group(comm)
        self.in_features, self.out_features = int(in_features), int(out_features)
        lo, hi = _split(self.in_features, size, rank, "in_features")
        self.local_in = hi - lo
        self.has_bias = bool(bias)
        self.scatter = None if input_is_parallel else ScatterToTensorParallel(comm)
        self.reduce_out = ReduceFromTensorParallel(comm)
        self.register_tp_parameter("weight", (self.in_features, self.out_features),
                                   TPPartition(0, lo, hi), "normal", scale)
        if self.has_bias:
            self.register_tp_parameter("bias", (self.out_features,), None, "zeros", 0.0)

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        w = self.param("weight")
        x = float_input(x, w.dtype, self.name)
        if self.scatter is not None:
            x = self.scatter.forward(x, ctx)
        check_features(x, self.local_in, self.name, "local in_features")
        y = self.reduce_out.forward(matmul_rows(x, w), ctx)
        if self.has_bias:
            y += self.param("bias")
        self._save(ctx, x)
        return y

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        x = self._take(ctx)
        w = self.param("weight")
        dy = self.reduce_out.backward(dy, ctx)
        dy2 = dy.reshape(-1, self.out_features)
        if self.has_bias:
            self.grad("bias")[...] += dy2.sum(axis=0)
        add_transposed_product(self.grad("weight"), x.reshape(-1, self.local_in), dy2)
        dx = matmul_rows(dy, w.T)
        return dx if self.scatter is None else self.scatter.backward(dx, ctx)


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
        self.register_tp_parameter("weight", (self.num_embeddings, self.embedding_dim),
                                   TPPartition(0, self.lo, self.hi), "normal", scale)

    def forward(self, ids: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        w = self.param("weight")
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{self.name}: ids must be integers, got dtype {arr.dtype}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.num_embeddings):
            bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
            raise ValueError(f"{self.name}: id {bad} is out of range for "
                             f"num_embeddings={self.num_embeddings}")
        mine = (arr >= self.lo) & (arr < self.hi)
        local = np.where(mine, arr - self.lo, 0)
        y = w[local]
        y[~mine] = 0
        self._save(ctx, (local, mine))
        return self.reduce_out.forward(y, ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> None:
        local, mine = self._take(ctx)
        dy = self.reduce_out.backward(dy, ctx)
        g = self.grad("weight")
        rows = local.reshape(-1)
        dy2 = dy.reshape(-1, self.embedding_dim) * mine.reshape(-1, 1)
        n = g.shape[0]
        if n <= 4096 and rows.size >= n:
            # Small vocabulary: a one-hot matmul runs in BLAS (as Embedding does).
            onehot = np.zeros((n, rows.size), dtype=g.dtype)
            onehot[rows, np.arange(rows.size)] = 1
            g += onehot @ dy2
        else:
            np.add.at(g, rows, dy2)
        return None


class VocabParallelLMHead(TensorParallelModule):
    """``logits = x @ weight.T`` with the ``(vocab_size, n_embd)`` weight split by rows:
    each rank returns its vocabulary slice of the logits (feed them to
    :class:`VocabParallelCrossEntropy`). With ``tied_to`` the weight is that
    :class:`VocabParallelEmbedding`'s (same rows on every rank)."""

    def __init__(self, n_embd: int, vocab_size: int, *, comm: Any,
                 tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        size, rank = _group(comm)
        self.n_embd, self.vocab_size = int(n_embd), int(vocab_size)
        lo, hi = _split(self.vocab_size, size, rank, "vocab_size")
        self.local_vocab = hi - lo
        self.copy_in = CopyToTensorParallel(comm)
        if tied_to is None:
            self.register_tp_parameter("weight", (self.vocab_size, self.n_embd),
                                       TPPartition(0, lo, hi), "normal", 0.02)
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
        w = self.param("weight")
        self.grad("weight")[...] += (dy.reshape(-1, self.local_vocab).T
                                     @ x.reshape(-1, self.n_embd))
        return self.copy_in.backward(matmul_rows(dy, w), ctx)


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

    def forward(  # type: ignore[override]
        self, logits: np.ndarray, targets: np.ndarray, normalizer: float | None = None,
        ctx: Hashable = None,
    ) -> float:
        logits = np.asarray(logits)
        targets = np.asarray(targets)
        vl = self.hi - self.lo
        if logits.dtype.kind != "f" or logits.shape[-1:] != (vl,):
            raise ValueError(f"logits of shape {logits.shape} are not this rank's {vl} classes")
        if targets.shape != logits.shape[:-1]:
            raise ValueError(
                f"targets of shape {targets.shape} do not match logits of shape {logits.shape}"
            )
        if targets.dtype.kind not in "iu":
            raise ValueError(f"targets must be integers, got dtype {targets.dtype}")
        if targets.size:
            lo, hi = int(targets.min()), int(targets.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"target {bad} is out of range for {self.vocab_size} classes")
        norm = float(targets.size if normalizer is None else normalizer)
        if not norm > 0:
            raise ValueError(f"normalizer={normalizer!r} must be > 0")
        z = logits.reshape(-1, vl)
        m = z.max(axis=-1)
        C.allreduce(m, "max", comm=self.comm)
        z = z - m[:, None]
        p = np.exp(z)
        t = targets.reshape(-1) - self.lo
        mine = (t >= 0) & (t < vl)
        tl = np.where(mine, t, 0)
        rows = np.arange(t.size)
        sums = np.stack([p.sum(axis=-1), np.where(mine, z[rows, tl], 0.0)])
        C.allreduce(sums, "sum", comm=self.comm)
        s, zt = sums[0], sums[1]
        nll = np.log(s) - zt
        p /= s[:, None]
        self._save(ctx, (p, tl, mine, norm, logits.shape))
        return float(np.sum(nll, dtype=np.float64)) / norm

    def backward(self, dy: float = 1.0, ctx: Hashable = None) -> np.ndarray:  # type: ignore[override]
        p, tl, mine, norm, shape = self._take(ctx)
        rows = np.arange(tl.size)
        p[rows[mine], tl[mine]] -= 1.0
        p *= float(dy) / norm
        return p.reshape(shape)


# -- the tensor-parallel GPT ----------------------------------------------------------------
class TPCausalSelfAttention(TensorParallelModule):
    """Causal self-attention with the heads split over tp (names as
    :class:`~mpidist.nn.CausalSelfAttention`: ``qkv``, ``proj``)."""

    def __init__(self, n_embd: int, n_head: int, n_layer: int = 1, bias: bool = True, *,
                 comm: Any) -> None:
        super().__init__()
        size, _ = _group(comm)
        if n_head % size:
            raise ValueError(f"tp={size} does not divide n_head={n_head}")
        self.n_embd, self.n_head = int(n_embd), int(n_head)
        self.head_dim = n_embd // n_head
        self.local_heads = n_head // size
        self.local_embd = self.local_heads * self.head_dim
        self.qkv = ColumnParallelLinear(n_embd, 3 * n_embd, comm=comm, bias=bias, groups=3)
        self.proj = RowParallelLinear(n_embd, n_embd, comm=comm, bias=bias,
                                      scale=residual_scale(n_layer))

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        x = np.asarray(x)
        if x.ndim != 3 or x.shape[-1] != self.n_embd:
            raise ValueError(
                f"{self.name}: input of shape {x.shape} is not (batch, time, n_embd={self.n_embd})"
            )
        # Keeps the log-sum-exp, not the probabilities: TPFeedForward keeps its GELU output.
        y, saved = causal_attention(self.qkv.forward(x, ctx), self.local_heads,
                                    keep_probabilities=False)
        self._save(ctx, saved)
        return self.proj.forward(y, ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        saved = self._take(ctx)
        return self.qkv.backward(causal_attention_backward(self.proj.backward(dy, ctx), saved),
                                 ctx)


class TPFeedForward(TensorParallelModule):
    """GPT-2 MLP, column-parallel ``fc`` → GELU → row-parallel ``proj`` (one allreduce
    forward, one backward)."""

    def __init__(self, n_embd: int, n_layer: int = 1, bias: bool = True, *, comm: Any) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(n_embd, 4 * n_embd, comm=comm, bias=bias)
        self.act = GELU()
        self.proj = RowParallelLinear(4 * n_embd, n_embd, comm=comm, bias=bias,
                                      scale=residual_scale(n_layer))

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return self.proj.forward(self.act.forward(self.fc.forward(x, ctx), ctx), ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return self.fc.backward(self.act.backward(self.proj.backward(dy, ctx), ctx), ctx)


class TPBlock(TensorParallelModule):
    """Pre-LN transformer block with tp attention and MLP; LayerNorms are replicated."""

    def __init__(self, config: GPTConfig, *, comm: Any) -> None:
        super().__init__()
        c = config
        self.ln_1 = LayerNorm(c.n_embd, c.layer_norm_eps)
        self.attn = TPCausalSelfAttention(c.n_embd, c.n_head, c.n_layer, c.bias, comm=comm)
        self.ln_2 = LayerNorm(c.n_embd, c.layer_norm_eps)
        self.mlp = TPFeedForward(c.n_embd, c.n_layer, c.bias, comm=comm)

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        h = x + self.attn.forward(self.ln_1.forward(x, ctx), ctx)
        return h + self.mlp.forward(self.ln_2.forward(h, ctx), ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        dh = dy + self.ln_2.backward(self.mlp.backward(dy, ctx), ctx)
        return dh + self.ln_1.backward(self.attn.backward(dh, ctx), ctx)


class TPGPTEmbedding(TensorParallelModule):
    """First unit: vocab-parallel ``wte`` plus replicated ``wpe``."""

    def __init__(self, config: GPTConfig, *, comm: Any) -> None:
        super().__init__()
        self.config = config
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, comm=comm)
        # Position embeddings are small and replicated: an ordinary table.
        self.wpe = Embedding(config.block_size, config.n_embd)
        self.drop = Dropout(config.dropout) if config.dropout > 0 else None

    # The same computation as the single-process embedding unit; only ``wte`` differs (its
    # forward already allreduces the vocabulary-sharded lookups over tp).
    forward = GPTEmbedding.forward
    backward = GPTEmbedding.backward


class TPGPTHead(TensorParallelModule):
    """Last unit: replicated ``ln_f`` and the vocab-parallel head (vocab-sharded logits)."""

    def __init__(self, config: GPTConfig, *, comm: Any,
                 tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.ln_f = LayerNorm(config.n_embd, config.layer_norm_eps)
        self.head = VocabParallelLMHead(config.n_embd, config.vocab_size, comm=comm,
                                        tied_to=tied_to)

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return self.head.forward(self.ln_f.forward(x, ctx), ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return self.ln_f.backward(self.head.backward(dy, ctx), ctx)


def check_tensor_parallel_gpt(config: GPTConfig, tp: int) -> None:
    """Raise ValueError unless ``tp`` divides n_head, n_embd and vocab_size. Pure."""
    for what in ("n_head", "n_embd", "vocab_size"):
        v = getattr(config, what)
        if v % tp:
            raise ValueError(f"tp={tp} does not divide {what}={v}")


class TensorParallelGPT(TensorParallelModule):
    """The tensor-parallel form of :class:`~mpidist.nn.GPT` for one tp rank.

    Built from the same :class:`GPTConfig`; same units (``embed``, ``blocks.i``, ``final``),
    same parameter names, and initial values equal to this rank's slices of the
    single-process model's. ``forward(idx)`` returns this rank's vocabulary slice of the
    logits; use :class:`VocabParallelCrossEntropy` as the loss. Collective over ``comm``.
    """

    def __init__(self, config: GPTConfig, *, comm: Any) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
        size, _ = _group(comm)
        check_tensor_parallel_gpt(config, size)
        self.config = config
        self.comm = comm
        self.embed = TPGPTEmbedding(config, comm=comm)
        self.blocks = ModuleList(TPBlock(config, comm=comm) for _ in range(config.n_layer))
        self.final = TPGPTHead(config, comm=comm,
                               tied_to=self.embed.wte if config.tie_weights else None)
        self._units = [self.embed, *self.blocks, self.final]

    @property
    def units(self) -> list[Module]:
        return list(self._units)

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        for unit in self._units:
            x = unit.forward(x, ctx)
        return x

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> None:
        for unit in reversed(self._units):
            dy = unit.backward(dy, ctx)
        return None

    def loss(self) -> VocabParallelCrossEntropy:
        """The matching vocab-parallel cross-entropy."""
        return VocabParallelCrossEntropy(self.comm, self.config.vocab_size)
