"""Tensor-parallel mappings and layers equal their single-process counterparts."""

from __future__ import annotations

import re
from collections.abc import Hashable

import numpy as np
import pytest

from mpidist.nn import GELU, GPT, MLP, CrossEntropyLoss, Embedding, GPTConfig, Linear, Module
from mpidist.nn.tensor_parallel import (
    GPT_PLAN,
    ColumnParallelLinear,
    ColwiseParallel,
    CopyToTensorParallel,
    GatherFromTensorParallel,
    ReduceFromTensorParallel,
    RowParallelLinear,
    RowwiseParallel,
    ScatterToTensorParallel,
    TensorParallelGPT,
    TensorParallelModule,
    TPPartition,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    check_plan,
    default_plan,
    parallelize,
    tp_partition,
    tp_partitions,
)

TOL = dict(rtol=1e-11, atol=1e-13)
EXACT = dict(rtol=1e-12, atol=1e-13)


class FakeComm:
    """A tp group of ``size`` that cannot communicate: what is checked before any
    communication raises before touching it."""

    def __init__(self, size: int) -> None:
        self.size = size

    def Get_size(self) -> int:
        return self.size

    def Get_rank(self) -> int:
        return 0


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


def _gpt_step_matches(ref, tp, ref_bufs, tp_bufs, x, y) -> None:
    """One forward and backward of the single-process GPT and its tensor-parallel form:
    the same loss, and this rank's slices of the same gradients."""
    (pr, gr), (pt, gt) = ref_bufs, tp_bufs
    lr, lt = CrossEntropyLoss(), tp.loss()
    assert lt.forward(tp.forward(x), y) == pytest.approx(lr.forward(ref.forward(x), y),
                                                         rel=1e-12)
    ref.backward(lr.backward())
    tp.backward(lt.backward())
    _check_slices(tp, gt, pt, gr, pr)


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
    with pytest.raises(ValueError, match="tp=3 does not divide n_head=4"):
        TensorParallelGPT(GPTConfig(vocab_size=63, n_head=4, n_embd=12), comm=FakeComm(3))
    with pytest.raises(ValueError, match="tp=3 does not divide vocab_size=64"):
        VocabParallelEmbedding(64, 4, comm=FakeComm(3))


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


def _one_error(module: Module, plan, tp: int) -> str:
    with pytest.raises(ValueError) as err:
        check_plan(module, plan, tp)
    with pytest.raises(ValueError, match="^" + re.escape(str(err.value)) + "$"):
        parallelize(module, plan, comm=FakeComm(tp))  # raised before any communication
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_plans_give_one_clear_line():
    mlp = MLP([4, 6, 3])
    assert _one_error(mlp, {"layers.0": "colwise", "layers.1": "rowwise"}, 4) == (
        "tp=4 does not divide out_features=6 of layer layers.0; "
        "tp=4 does not divide in_features=6 of layer layers.1")
    assert _one_error(mlp, {"layers.9": "colwise"}, 2) == \
        "plan pattern 'layers.9' matches no layer of the MLP"
    assert _one_error(mlp, {"layers.*": "vocab"}, 2) == \
        "style 'vocab' applies to an Embedding or LMHead; layer layers.0 is a Dense"
    assert "style 'diagonal' of plan pattern 'layers.0' is not one of" in \
        _one_error(mlp, {"layers.0": "diagonal"}, 2)
    assert _one_error(mlp, {"layers.0": "colwise", "layers.*": "rowwise"}, 2) == \
        "layer layers.0 matches plan patterns 'layers.0' and 'layers.*'"
    gpt = GPT(GPTConfig(vocab_size=64, n_head=4, n_embd=16, tie_weights=True))
    plan = {k: v for k, v in GPT_PLAN.items() if k != "final.head"}
    assert _one_error(gpt, plan, 2).startswith(
        "layer final.head is tied to embed.wte.weight: both layers need the same style")
    assert _one_error(gpt, {"blocks.*.attn.qkv": ColwiseParallel(groups=3)}, 3) == (
        "tp=3 does not divide out_features=48 / 3 blocks = 16 of layer blocks.0.attn.qkv")
    with pytest.raises(ValueError, match="no default tensor-parallel plan for a Linear"):
        default_plan(Linear(2, 3))
    with pytest.raises(ValueError, match="tp=0 must be a positive integer"):
        check_plan(mlp, {}, 0)


def test_default_plans():
    assert default_plan(GPT(GPTConfig())) == dict(GPT_PLAN)
    assert default_plan(MLP([3, 4, 5, 6, 7, 8])) == {
        "layers.0": ColwiseParallel(), "layers.1": RowwiseParallel(),
        "layers.2": ColwiseParallel(), "layers.3": RowwiseParallel()}  # layers.4 replicated
    styles = check_plan(GPT(GPTConfig(n_layer=1)), GPT_PLAN, 2)
    assert list(styles) == ["embed.wte", "blocks.0.attn", "blocks.0.attn.qkv",
                            "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj",
                            "final.head"]


def test_parallelize_single_rank_equals_mlp_and_leaves_it_usable():
    ref = MLP([5, 8, 6, 4], activation="tanh")
    pr, gr = ref.build(np.float64, seed=3)
    before = pr.data.copy()
    tp = parallelize(ref, default_plan(ref), comm=None)
    assert not tp.is_bound and ref.is_bound
    with pytest.raises(ValueError, match="already tensor parallel"):
        parallelize(tp, default_plan(ref), comm=None)
    assert tp.named_parameter_shapes() == ref.named_parameter_shapes()
    assert [type(u).__name__ for u in tp.units] == \
        ["ColumnParallelLinear", "RowParallelLinear", "Dense"]
    pt, gt = tp.build(np.float64, seed=3)
    np.testing.assert_array_equal(pt.data, pr.data)
    np.testing.assert_array_equal(pr.data, before)
    x = np.random.default_rng(0).standard_normal((3, 5))
    np.testing.assert_array_equal(tp.forward(x), ref.forward(x))
    dy = np.random.default_rng(1).standard_normal((3, 4))
    np.testing.assert_array_equal(tp.backward(dy), ref.backward(dy))
    np.testing.assert_array_equal(gt.data, gr.data)


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
    _gpt_step_matches(ref, tp, (pr, gr), (pt, gt),
                      rng.integers(0, 256, (3, 8)), rng.integers(0, 256, (3, 8)))


def _mlp_case(comm, sizes, activation, plan=None):
    ref = MLP(sizes, activation)
    pr, gr = ref.build(np.float64, seed=5)
    tp = parallelize(ref, plan or default_plan(ref), comm=comm)
    pt, gt = tp.build(np.float64, seed=5)
    x = np.random.default_rng(0).standard_normal((6, sizes[0]))
    dy = np.random.default_rng(1).standard_normal((6, sizes[-1]))
    y_tp = tp.forward(x)
    np.testing.assert_allclose(y_tp, ref.forward(x), **EXACT)
    np.testing.assert_allclose(tp.backward(dy), ref.backward(dy), **EXACT)
    _check_slices(tp, gt, pt, gr, pr)
    # Unit by unit (as ZeRO-3 and the pipeline run them) equals the whole model.
    h = x
    for u in tp.units:
        h = u.forward(h, ctx="u")
    np.testing.assert_allclose(h, y_tp, **EXACT)
    tp.clear_cache()
    return tp


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sizes,activation", [([5, 24, 12, 24, 7], "relu"),
                                              ([5, 24, 6, 7], "gelu"),
                                              ([3, 12, 2], "tanh")])
def test_mlp_under_its_plan_equals_mlp(comm, sizes, activation):
    n = comm.Get_size()
    tp = _mlp_case(comm, sizes, activation)
    parts = tp_partitions(tp)
    assert parts["layers.0.weight"] == (TPPartition(1, 0, sizes[1] // n).for_rank(
        comm.Get_rank()), (sizes[0], sizes[1]))
    assert "layers.1.bias" not in parts  # a row-parallel bias is replicated


@pytest.mark.mpi(min_size=2)
def test_gathered_colwise_then_split_rowwise_equals_mlp(comm):
    plan = {"layers.0": ColwiseParallel(gather_output=True),
            "layers.1": RowwiseParallel(input_is_parallel=False)}
    _mlp_case(comm, [5, 24, 12, 7], "relu", plan)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tie", [False, True])
def test_parallelized_gpt_equals_gpt(comm, tie):
    n = comm.Get_size()
    if 4 % n:
        pytest.skip(f"tp={n} does not divide the test GPT's n_head=4")
    cfg = GPTConfig(vocab_size=96, block_size=8, n_layer=2, n_head=4, n_embd=16,
                    tie_weights=tie)
    ref = GPT(cfg)
    pr, gr = ref.build(np.float64, seed=2)
    tp = parallelize(ref, default_plan(ref), comm=comm)
    pt, gt = tp.build(np.float64, seed=2)
    assert isinstance(tp, GPT) and tp.config == cfg
    rng = np.random.default_rng(3)
    _gpt_step_matches(ref, tp, (pr, gr), (pt, gt),
                      rng.integers(0, 96, (2, 8)), rng.integers(0, 96, (2, 8)))
    assert tp.blocks[0].attn.n_head == 4 // n and ref.blocks[0].attn.n_head == 4
