"""The split backward of a zero-bubble schedule: ``backward_input`` (B) then ``backward_weight``
(W) equals ``backward``.

Everything runs in float64 under both kernel choices. With one micro-batch, and with several
whose W passes run in the order their backwards would, input and parameter gradients are equal
bit for bit (the same operations on the same arrays). When the W passes of several
micro-batches run in another order, each parameter gradient is the same sum of the same
per-micro-batch terms added in another order, so it agrees to round-off only (1e-14 relative
to the largest entry), not bitwise.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence

import numpy as np
import pytest

from mpidist.nn import (
    GELU,
    GPT,
    MLP,
    Dense,
    Dropout,
    Embedding,
    GPTConfig,
    Identity,
    LayerNorm,
    Linear,
    Module,
    ReLU,
    Sequential,
    Tanh,
)
from mpidist.nn import fused as F
from mpidist.nn.attention import Block, CausalSelfAttention, FeedForward
from mpidist.nn.models import LMHead
from mpidist.nn.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelGPT,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    default_plan,
    parallelize,
)

KERNELS = pytest.mark.parametrize("kernels", ["numba", "numpy"])
MICRO = 4
W_ORDER = [2, 0, 3, 1]  # another order than backward's


def _float(shape: tuple[int, ...]) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: rng.standard_normal(shape)


def _ids(shape: tuple[int, ...], high: int) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda rng: rng.integers(0, high, size=shape)


def _reset(module: Module) -> None:
    for m in module.modules():
        if isinstance(m, Dropout):
            m.reset_rng()


def _grads(module: Module) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in module.gradients().items()} if module.is_bound else {}


def _batches(make_x: Callable, out_shape: Callable, n: int, seed: int = 1) -> list[tuple]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = make_x(rng)
        out.append((x, rng.standard_normal(out_shape(x))))
    return out


def run_full(module: Module, batches: Sequence[tuple]) -> tuple[list, dict]:
    """Forward every micro-batch (ctx 0..n-1), then backward each in turn."""
    _reset(module)
    module.zero_grad()
    for i, (x, _) in enumerate(batches):
        module.forward(x, ctx=i)
    dxs = [module.backward(dy.copy(), ctx=i) for i, (_, dy) in enumerate(batches)]
    return dxs, _grads(module)


def run_split(module: Module, batches: Sequence[tuple],
              w_order: Sequence[int] | None = None) -> tuple[list, dict]:
    """Forward every micro-batch, B of all of them, then W in ``w_order`` (default: B's)."""
    _reset(module)
    module.zero_grad()
    for i, (x, _) in enumerate(batches):
        module.forward(x, ctx=i)
    dxs = [module.backward_input(dy.copy(), ctx=i) for i, (_, dy) in enumerate(batches)]
    untouched = _grads(module)
    for name, g in untouched.items():  # B writes no gradient buffer
        assert not g.any(), f"backward_input wrote the gradient of {name}"
    assert module.pending_weight_contexts() == (set(range(len(batches))) if untouched
                                                else set())
    for i in range(len(batches)) if w_order is None else w_order:
        module.backward_weight(ctx=i)
    assert not module.pending_weight_contexts()
    assert all(not m._cache for m in module.modules())
    return dxs, _grads(module)


def _equal(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


def check_split(module: Module, make_x: Callable, out_shape: Callable) -> None:
    """One micro-batch, and MICRO micro-batches with W in B's order and in W_ORDER."""
    for n in (1, MICRO):
        batches = _batches(make_x, out_shape, n)
        dx_full, g_full = run_full(module, batches)
        dx_split, g_split = run_split(module, batches)
        for i, (a, b) in enumerate(zip(dx_full, dx_split, strict=True)):
            assert _equal(a, b), f"input gradient of micro-batch {i} differs"
        assert g_full.keys() == g_split.keys()
        for name in g_full:
            assert _equal(g_full[name], g_split[name]), f"gradient of {name} differs (n={n})"
    _, g_other = run_split(module, batches, W_ORDER)
    for name, g in g_full.items():
        np.testing.assert_allclose(g_other[name], g, rtol=0,
                                   atol=1e-14 * float(np.abs(g).max() or 1.0), err_msg=name)


def _same_shape(x: np.ndarray) -> tuple[int, ...]:
    return x.shape


def _last(n: int) -> Callable[[np.ndarray], tuple[int, ...]]:
    return lambda x: x.shape[:-1] + (n,)


def _built(module: Module) -> Module:
    module.build(np.float64, seed=3)
    return module


def _gpt_config(**kw: object) -> GPTConfig:
    base = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8)
    base.update(kw)
    return GPTConfig(**base)  # type: ignore[arg-type]


# (name, module factory, input maker, output-gradient shape)
LAYERS: list[tuple[str, Callable[[], Module], Callable, Callable]] = [
    ("linear", lambda: Linear(5, 7), _float((3, 4, 5)), _last(7)),
    ("linear-nobias", lambda: Linear(5, 7, bias=False), _float((6, 5)), _last(7)),
    ("dense-relu", lambda: Dense(5, 7, "relu"), _float((6, 5)), _last(7)),
    ("dense-tanh", lambda: Dense(5, 7, "tanh"), _float((2, 3, 5)), _last(7)),
    ("dense-gelu", lambda: Dense(5, 7, "gelu"), _float((6, 5)), _last(7)),
    ("dense-none", lambda: Dense(5, 7, None), _float((6, 5)), _last(7)),
    ("embedding", lambda: Embedding(11, 6), _ids((3, 5), 11), lambda x: x.shape + (6,)),
    ("layernorm", lambda: LayerNorm(6), _float((3, 5, 6)), _same_shape),
    ("gelu", GELU, _float((4, 6)), _same_shape),
    ("relu", ReLU, _float((4, 6)), _same_shape),
    ("tanh", Tanh, _float((4, 6)), _same_shape),
    ("identity", Identity, _float((4, 6)), _same_shape),
    ("dropout", lambda: Dropout(0.3, seed=5), _float((4, 6)), _same_shape),
    ("sequential", lambda: Sequential(Linear(5, 8), Tanh(), LayerNorm(8), Dense(8, 3, "relu")),
     _float((4, 5)), _last(3)),
    ("attention-P", lambda: CausalSelfAttention(8, 2), _float((2, 6, 8)), _same_shape),
    ("attention-lse", lambda: CausalSelfAttention(8, 4), _float((2, 12, 8)), _same_shape),
    ("feedforward", lambda: FeedForward(8), _float((2, 5, 8)), _same_shape),
    ("feedforward-nobias", lambda: FeedForward(8, bias=False), _float((2, 5, 8)), _same_shape),
    ("block", lambda: Block(8, 2, n_layer=2), _float((2, 6, 8)), _same_shape),
    ("block-long", lambda: Block(8, 4), _float((2, 12, 8)), _same_shape),
    ("lmhead", lambda: LMHead(8, 13), _float((2, 5, 8)), _last(13)),
    ("mlp", lambda: MLP([5, 9, 7, 3], "gelu"), _float((6, 5)), _last(3)),
    ("column-parallel", lambda: ColumnParallelLinear(5, 6, comm=None, activation="gelu",
                                                     gather_output=True), _float((4, 5)),
     _last(6)),
    ("row-parallel", lambda: RowParallelLinear(6, 4, comm=None, input_is_parallel=False,
                                               activation="relu"), _float((4, 6)), _last(4)),
    ("vocab-embedding", lambda: VocabParallelEmbedding(12, 5, comm=None), _ids((3, 4), 12),
     lambda x: x.shape + (5,)),
    ("vocab-lmhead", lambda: VocabParallelLMHead(5, 12, comm=None), _float((3, 4, 5)),
     _last(12)),
]


@KERNELS
@pytest.mark.parametrize("name,factory,make_x,out_shape", LAYERS, ids=[c[0] for c in LAYERS])
def test_layer_split_equals_backward(kernels: str, name: str, factory: Callable,
                                     make_x: Callable, out_shape: Callable) -> None:
    module = factory()
    if module.parameter_names():
        _built(module)
    with F.use_kernels(kernels):
        check_split(module, make_x, out_shape)


@KERNELS
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_gpt_units_split_equals_backward(kernels: str, tied: bool, dropout: float) -> None:
    """Each unit alone (embedding, a block, the final unit) and the whole model."""
    cfg = _gpt_config(tie_weights=tied, dropout=dropout)
    model = _built(GPT(cfg))
    b, t, c, v = 2, 9, cfg.n_embd, cfg.vocab_size
    with F.use_kernels(kernels):
        check_split(model.embed, _ids((b, t), v), lambda x: x.shape + (c,))
        check_split(model.blocks[1], _float((b, t, c)), _same_shape)
        check_split(model.final, _float((b, t, c)), _last(v))
        check_split(model, _ids((b, t), v), lambda x: x.shape + (v,))


def test_units_split_equals_model_backward() -> None:
    """A pipeline stage's view: B unit by unit in reverse, then W of every unit, equals the
    model's backward (the tied head and embedding add into one gradient in backward's order)."""
    model = _built(GPT(_gpt_config(tie_weights=True)))
    batches = _batches(_ids((2, 7), 32), lambda x: x.shape + (32,), 1)
    _, g_full = run_full(model, batches)
    model.zero_grad()
    (x, dy), = batches
    model.forward(x, ctx="m")
    for unit in reversed(model.units):
        dy = unit.backward_input(dy, ctx="m")
    for unit in reversed(model.units):
        unit.backward_weight(ctx="m")
    for name, g in model.gradients().items():
        assert np.array_equal(g, g_full[name]), name


def test_layernorm_chunked_partial_sums() -> None:
    """With several Numba threads the fused layer-norm pass sums its parameter gradients per
    chunk of rows; W adds the chunks in the kernel's order, so the result stays bitwise."""
    numba = pytest.importorskip("numba")
    if not F.HAVE_NUMBA or numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs Numba with at least 2 threads")
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        with F.use_kernels("numba"):
            check_split(_built(LayerNorm(6)), _float((7, 6)), _same_shape)
    finally:
        numba.set_num_threads(before)


def test_split_errors() -> None:
    lin = _built(Linear(3, 2))
    with pytest.raises(RuntimeError, match="no matching backward_input"):
        lin.backward_weight(ctx=0)
    lin.forward(np.ones((2, 3)), ctx=0)
    with pytest.raises(ValueError, match="output gradient of shape"):
        lin.backward_input(np.ones((2, 3)), ctx=0)
    lin.forward(np.ones((2, 3)), ctx=0)
    lin.backward_input(np.ones((2, 2)), ctx=0)
    lin.forward(np.ones((2, 3)), ctx=0)
    with pytest.raises(RuntimeError, match="ran twice without backward_weight"):
        lin.backward_input(np.ones((2, 2)), ctx=0)
    lin.clear_cache()
    assert not lin.pending_weight_contexts()


class _Scaled(Module):
    """A leaf with a parameter and only an unsplit backward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("s", (1,), "ones", 1.0)

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return x * self.s

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return dy * self.s


class _Residual(Module):
    """A container whose backward is not a chain of its children's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = Linear(3, 3)

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return x + self.lin.forward(x, ctx)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return dy + self.lin.backward(dy, ctx)


def test_default_refuses_what_it_cannot_split() -> None:
    with pytest.raises(NotImplementedError, match="does not split its backward"):
        _built(_Scaled()).backward_input(np.ones(2))
    with pytest.raises(NotImplementedError, match="not a chain"):
        _built(_Residual()).backward_input(np.ones((1, 3)))
    # A parameterless layer's B is its backward; its W does nothing.
    relu = ReLU()
    relu.forward(np.array([-1.0, 2.0]), ctx=1)
    assert np.array_equal(relu.backward_input(np.array([5.0, 5.0]), ctx=1), [0.0, 5.0])
    relu.backward_weight(ctx=1)


# -- tensor parallelism under MPI -----------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tied", [False, True])
def test_tensor_parallel_gpt_split(comm, tied: bool) -> None:
    cfg = _gpt_config(n_head=4, n_embd=16, vocab_size=64, tie_weights=tied)
    if cfg.n_head % comm.Get_size():
        pytest.skip(f"tp={comm.Get_size()} does not divide n_head={cfg.n_head}")
    model = _built(TensorParallelGPT(cfg, comm=comm))
    local_v = cfg.vocab_size // comm.Get_size()
    b, t, c = 2, 8, cfg.n_embd
    check_split(model.embed, _ids((b, t), cfg.vocab_size), lambda x: x.shape + (c,))
    check_split(model.blocks[0], _float((b, t, c)), _same_shape)
    check_split(model.final, _float((b, t, c)), _last(local_v))
    check_split(model, _ids((b, t), cfg.vocab_size), lambda x: x.shape + (local_v,))


@pytest.mark.mpi(min_size=2)
def test_tensor_parallel_layers_split(comm) -> None:
    tp = comm.Get_size()
    mlp = MLP([5, 4 * tp, 3 * tp, 2], "tanh")
    check_split(_built(parallelize(mlp, default_plan(mlp), comm=comm)), _float((6, 5)),
                _last(2))
    check_split(_built(ColumnParallelLinear(5, 2 * tp, comm=comm, activation="gelu",
                                            gather_output=True)), _float((4, 5)), _last(2 * tp))
    check_split(_built(RowParallelLinear(2 * tp, 3, comm=comm, input_is_parallel=False,
                                         activation="relu")), _float((4, 2 * tp)), _last(3))
    check_split(_built(VocabParallelEmbedding(4 * tp, 5, comm=comm)), _ids((3, 4), 4 * tp),
                lambda x: x.shape + (5,))
    check_split(_built(VocabParallelLMHead(5, 4 * tp, comm=comm)), _float((3, 4, 5)),
                _last(4))


@pytest.mark.cudasim
@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
                    reason="needs NUMBA_ENABLE_CUDASIM=1")
def test_layer_norm_split_kernels_cudasim() -> None:
    """On a GPU the split runs the fused backward's two kernels apart: same bits."""
    from numba import cuda

    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    w, b = cuda.to_device(rng.standard_normal(4)), cuda.to_device(np.zeros(4))
    _, mean, rstd = F.layer_norm(cuda.to_device(x), w, b, 1e-5)
    grads = [cuda.to_device(np.full(4, 0.5)) for _ in range(4)]
    dx = F.layer_norm_backward(cuda.to_device(dy), cuda.to_device(x), w, mean, rstd, *grads[:2])
    dx2, kept = F.layer_norm_backward_input(cuda.to_device(dy), cuda.to_device(x), w, mean, rstd)
    F.layer_norm_backward_weight(kept, *grads[2:])
    assert np.array_equal(dx.copy_to_host(), dx2.copy_to_host())
    for a, c in zip(grads[:2], grads[2:], strict=True):
        assert np.array_equal(a.copy_to_host(), c.copy_to_host())
