"""Tensor-parallel mappings and layers equal their single-process counterparts."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import pytest

from mpidist.nn import GELU, GPT, CrossEntropyLoss, Embedding, GPTConfig, Linear, Module
from mpidist.nn.tensor_parallel import (
    ColumnParallelLinear,
    CopyToTensorParallel,
    GatherFromTensorParallel,
    ReduceFromTensorParallel,
    RowParallelLinear,
    ScatterToTensorParallel,
    TensorParallelGPT,
    TensorParallelModule,
    TPPartition,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    tp_partition,
    tp_partitions,
)

TOL = dict(rtol=1e-11, atol=1e-13)


class SerialMLP(Module):
    def __init__(self, d: int, h: int, o: int) -> None:
        super().__init__()
        self.fc = Linear(d, h)
        self.act = GELU()
        self.proj = Linear(h, o)

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return self.proj.forward(self.act.forward(self.fc.forward(x, ctx), ctx), ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return self.fc.backward(self.act.backward(self.proj.backward(dy, ctx), ctx), ctx)


class ParallelMLP(TensorParallelModule):
    def __init__(self, d: int, h: int, o: int, comm) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(d, h, comm=comm)
        self.act = GELU()
        self.proj = RowParallelLinear(h, o, comm=comm)

    forward = SerialMLP.forward
    backward = SerialMLP.backward


def _check_slices(tp_model: Module, grads_tp, params_tp, grads_ref, params_ref) -> None:
    parts = tp_partitions(tp_model)
    for name, ref in params_ref.views().items():
        part = parts.get(name, (None,))[0]
        want_p = ref if part is None else part.take(ref)
        np.testing.assert_array_equal(params_tp[name], want_p, err_msg=name)
        g = grads_ref[name]
        want_g = g if part is None else part.take(g)
        np.testing.assert_allclose(grads_tp[name], want_g, **TOL, err_msg=name)


# -- pure ---------------------------------------------------------------------------------
def test_partition_index_and_ranges():
    full = np.arange(4 * 12).reshape(4, 12)
    p = TPPartition(1, 2, 4, groups=3)  # rank 1 of tp=2 on q|k|v blocks of 4 columns
    assert p.ranges(full.shape) == [(2, 4), (6, 8), (10, 12)]
    np.testing.assert_array_equal(p.take(full), full[:, [2, 3, 6, 7, 10, 11]])
    assert p.for_rank(0) == TPPartition(1, 0, 2, 3)
    assert p.local_shape((4, 12)) == (4, 6)
    q = TPPartition(0, 2, 4)
    np.testing.assert_array_equal(q.take(full), full[2:4])


def test_single_rank_tp_gpt_equals_gpt():
    cfg = GPTConfig(vocab_size=64, block_size=6, n_layer=2, n_head=2, n_embd=8)
    a, b = GPT(cfg), TensorParallelGPT(cfg, comm=None)
    assert a.named_parameter_shapes() == b.named_parameter_shapes()
    pa, ga = a.build(np.float64, seed=1)
    pb, gb = b.build(np.float64, seed=1)
    np.testing.assert_array_equal(pa.data, pb.data)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 64, (3, 6)), rng.integers(0, 64, (3, 6))
    la, lb = CrossEntropyLoss(), b.loss()
    assert la.forward(a.forward(x), y) == pytest.approx(lb.forward(b.forward(x), y), rel=1e-14)
    a.backward(la.backward())
    b.backward(lb.backward())
    np.testing.assert_allclose(ga.data, gb.data, **TOL)
    assert b.tp_partition("blocks.0.attn.qkv.weight") == TPPartition(1, 0, 8, 3)
    assert b.tp_partition("blocks.0.ln_1.weight") is None
    assert tp_partition(a, "embed.wte.weight") is None


def test_bad_tp_sizes_name_the_values():
    class FakeComm:
        def Get_size(self):
            return 3

        def Get_rank(self):
            return 0

    with pytest.raises(ValueError, match="tp=3 does not divide n_head=4"):
        TensorParallelGPT(GPTConfig(vocab_size=63, n_head=4, n_embd=12), comm=FakeComm())
    with pytest.raises(ValueError, match="tp=3 does not divide vocab_size=64"):
        VocabParallelEmbedding(64, 4, comm=FakeComm())


def test_column_parallel_gradcheck_single_rank():
    lin = ColumnParallelLinear(3, 6, comm=None, groups=3)
    params, grads = lin.build(np.float64, seed=2)
    params.data[:] = np.random.default_rng(3).standard_normal(params.data.shape)
    x = np.random.default_rng(4).standard_normal((2, 3))
    w = np.random.default_rng(5).standard_normal((2, 6))
    lin.forward(x)
    dx = lin.backward(w)
    eps = 1e-6
    for i in range(params.data.size):
        old = params.data[i]
        params.data[i] = old + eps
        up = float(np.sum(lin.forward(x) * w))
        params.data[i] = old - eps
        down = float(np.sum(lin.forward(x) * w))
        params.data[i] = old
        assert grads.data[i] == pytest.approx((up - down) / (2 * eps), rel=1e-6, abs=1e-8)
    lin.clear_cache()
    num = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        num[idx] = (np.sum(lin.forward(xp) * w) - np.sum(lin.forward(xm) * w)) / (2 * eps)
    np.testing.assert_allclose(dx, num, rtol=1e-6, atol=1e-8)


# -- MPI ----------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_mappings_forward_backward(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    x = np.full((2, 3), float(r + 1))
    total = n * (n + 1) / 2
    copy, reduce = CopyToTensorParallel(comm), ReduceFromTensorParallel(comm)
    assert copy.forward(x) is x
    np.testing.assert_array_equal(copy.backward(x), np.full((2, 3), total))
    np.testing.assert_array_equal(reduce.forward(x), np.full((2, 3), total))
    assert reduce.backward(x) is x
    whole = np.arange(2 * 2 * n, dtype=np.float64).reshape(2, 2 * n)
    mine = whole[:, 2 * r:2 * r + 2]
    gather, scatter = GatherFromTensorParallel(comm), ScatterToTensorParallel(comm)
    np.testing.assert_array_equal(gather.forward(mine), whole)
    np.testing.assert_array_equal(gather.backward(whole), mine)
    np.testing.assert_array_equal(scatter.forward(whole), mine)
    np.testing.assert_array_equal(scatter.backward(mine), whole)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("gather", [False, True])
def test_column_row_mlp_equals_single_process(comm, gather):
    d, h, o = 5, 24, 7  # h divides by 2, 3, 4
    ref = SerialMLP(d, h, o)
    pr, gr = ref.build(np.float64, seed=4)
    tp = ParallelMLP(d, h, o, comm)
    pt, gt = tp.build(np.float64, seed=4)
    x = np.random.default_rng(0).standard_normal((3, 4, d))
    dy = np.random.default_rng(1).standard_normal((3, 4, o))
    y_ref, y_tp = ref.forward(x), tp.forward(x)
    np.testing.assert_allclose(y_tp, y_ref, **TOL)
    np.testing.assert_allclose(tp.backward(dy), ref.backward(dy), **TOL)
    _check_slices(tp, gt, pt, gr, pr)
    if gather:
        # A column-parallel layer with a gathered output equals the plain Linear.
        col = ColumnParallelLinear(d, h, comm=comm, gather_output=True)
        lin = Linear(d, h)
        pc, gc = col.build(np.float64, seed=6)
        pl, gl = lin.build(np.float64, seed=6)
        np.testing.assert_allclose(col.forward(x), lin.forward(x), **TOL)
        g = np.random.default_rng(2).standard_normal((3, 4, h))
        np.testing.assert_allclose(col.backward(g), lin.backward(g), **TOL)
        _check_slices(col, gc, pc, gl, pl)


@pytest.mark.mpi(min_size=2)
def test_vocab_parallel_embedding_and_cross_entropy(comm):
    n = comm.Get_size()
    v = 12 * n
    emb, ref = VocabParallelEmbedding(v, 5, comm=comm), Embedding(v, 5)
    pe, ge = emb.build(np.float64, seed=7)
    pr, gr = ref.build(np.float64, seed=7)
    ids = np.random.default_rng(0).integers(0, v, (4, 6))
    np.testing.assert_allclose(emb.forward(ids), ref.forward(ids), **TOL)
    dy = np.random.default_rng(1).standard_normal((4, 6, 5))
    emb.backward(dy)
    ref.backward(dy)
    _check_slices(emb, ge, pe, gr, pr)
    logits = np.random.default_rng(2).standard_normal((4, 6, v)) * 3
    r = comm.Get_rank()
    ce, ce_ref = VocabParallelCrossEntropy(comm, v), CrossEntropyLoss()
    got = ce.forward(logits[..., r * 12:(r + 1) * 12], ids, normalizer=50.0)
    want = ce_ref.forward(logits, ids, normalizer=50.0)
    assert got == pytest.approx(want, rel=1e-13)
    np.testing.assert_allclose(ce.backward(), ce_ref.backward()[..., r * 12:(r + 1) * 12],
                               **TOL)


@pytest.mark.mpi(min_size=2)
def test_tensor_parallel_gpt_equals_gpt(comm):
    n = comm.Get_size()
    if 4 % n:
        pytest.skip(f"tp={n} does not divide the test GPT's n_head=4")
    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=4, n_embd=16)
    ref, tp = GPT(cfg), TensorParallelGPT(cfg, comm=comm)
    pr, gr = ref.build(np.float64, seed=0)
    pt, gt = tp.build(np.float64, seed=0)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (3, 8)), rng.integers(0, 256, (3, 8))
    lr, lt = CrossEntropyLoss(), tp.loss()
    assert lt.forward(tp.forward(x), y) == pytest.approx(lr.forward(ref.forward(x), y),
                                                         rel=1e-12)
    ref.backward(lr.backward())
    tp.backward(lt.backward())
    _check_slices(tp, gt, pt, gr, pr)
