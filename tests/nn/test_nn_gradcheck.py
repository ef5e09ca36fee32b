"""Finite-difference gradient checks (float64, central differences) for every layer and model."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from mpidist.core.buffers import FlatBuffer
from mpidist.nn import (
    GELU,
    GPT,
    MLP,
    Block,
    CausalSelfAttention,
    CrossEntropyLoss,
    Dense,
    Dropout,
    Embedding,
    FeedForward,
    GPTConfig,
    LayerNorm,
    Linear,
    Module,
    MSELoss,
    ReLU,
    Sequential,
    Tanh,
)

EPS = 1e-6
TOL = 1e-6


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """Norm-wise relative error, robust to individual near-zero entries."""
    denom = max(np.linalg.norm(a), np.linalg.norm(b), 1e-12)
    return float(np.linalg.norm(a - b) / denom)


def numeric_grad(f: Callable[[], float], arr: np.ndarray, max_entries: int | None = None,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Central differences of ``f`` w.r.t. entries of ``arr`` (perturbed in place)."""
    flat = arr.reshape(-1)
    idx = np.arange(flat.size)
    if max_entries is not None and flat.size > max_entries:
        idx = np.sort(np.random.default_rng(seed).choice(flat.size, max_entries, replace=False))
    out = np.empty(idx.size)
    for j, i in enumerate(idx):
        old = flat[i]
        flat[i] = old + EPS
        fp = f()
        flat[i] = old - EPS
        fm = f()
        flat[i] = old
        out[j] = (fp - fm) / (2 * EPS)
    return idx, out


def check_module(module: Module, x: np.ndarray, seed: int = 0, check_input: bool = True,
                 max_entries: int | None = None) -> None:
    """Check input and parameter gradients of ``module`` at ``x`` for f = sum(forward(x) * R)."""
    has_params = bool(module.named_parameter_shapes())
    if has_params:
        params, grads = module.build(np.float64, seed=seed)
        # Perturb away from the structured init (ones/zeros) so every path is exercised.
        params.data += 0.1 * np.random.default_rng(seed + 1).standard_normal(params.data.shape)
    y = module.forward(x)
    r = np.random.default_rng(seed + 2).standard_normal(y.shape)
    dx = module.backward(r)

    def f() -> float:
        out = float(np.sum(module.forward(x) * r))
        module.clear_cache()
        return out

    if check_input:
        idx, num = numeric_grad(f, x, max_entries, seed)
        assert dx.dtype == np.float64
        err = rel_err(dx.reshape(-1)[idx], num)
        assert err <= TOL, f"input gradient relative error {err:.2e}"
    if has_params:
        idx, num = numeric_grad(f, params.data, max_entries, seed)
        err = rel_err(grads.data[idx], num)
        assert err <= TOL, f"parameter gradient relative error {err:.2e}"


RNG = np.random.default_rng(1234)


@pytest.mark.parametrize(
    "make,shape",
    [
        (lambda: Linear(5, 4), (3, 5)),
        (lambda: Linear(5, 4, bias=False), (2, 3, 5)),
        (lambda: Linear(3, 6, init="uniform"), (4, 3)),
        (lambda: LayerNorm(6), (2, 3, 6)),
        (lambda: GELU(), (3, 7)),
        (lambda: Tanh(), (3, 7)),
        (lambda: Dense(4, 3, "relu"), (5, 4)),
        (lambda: Dense(4, 3, "gelu"), (5, 4)),
        (lambda: Sequential(Linear(4, 6), GELU(), Linear(6, 2)), (3, 4)),
        (lambda: CausalSelfAttention(8, 2), (2, 5, 8)),
        (lambda: CausalSelfAttention(6, 3, n_layer=2, bias=False), (1, 4, 6)),
        (lambda: FeedForward(4), (2, 3, 4)),
        (lambda: Block(8, 2, n_layer=2), (2, 4, 8)),
    ],
    ids=["linear", "linear-nobias", "linear-uniform", "layernorm", "gelu", "tanh", "dense-relu",
         "dense-gelu", "sequential", "attention", "attention-nobias", "feedforward", "block"],
)
def test_layer_gradients(make: Callable[[], Module], shape: tuple[int, ...]) -> None:
    x = RNG.standard_normal(shape)
    check_module(make(), x)


def test_relu_gradient_away_from_kink() -> None:
    x = RNG.standard_normal((4, 5))
    x[np.abs(x) < 0.05] = 0.5  # central differences are wrong within EPS of the kink
    check_module(ReLU(), x)


def test_dropout_gradient_matches_mask() -> None:
    d = Dropout(0.3, seed=5)
    x = RNG.standard_normal((6, 7))
    y = d.forward(x)
    dx = d.backward(np.ones_like(x))
    mask = y / np.where(x == 0, 1, x)
    np.testing.assert_allclose(dx, mask, rtol=1e-12, atol=1e-12)
    # Eval mode is the identity, with identity gradient.
    d.eval()
    np.testing.assert_array_equal(d.forward(x), x)
    np.testing.assert_array_equal(d.backward(x), x)


def test_embedding_gradient() -> None:
    emb = Embedding(7, 3)
    params, grads = emb.build(np.float64, seed=3)
    ids = np.array([[0, 3, 3], [6, 1, 3]])
    r = RNG.standard_normal((2, 3, 3))
    emb.forward(ids)
    assert emb.backward(r) is None

    def f() -> float:
        out = float(np.sum(emb.forward(ids) * r))
        emb.clear_cache()
        return out

    _, num = numeric_grad(f, params.data)
    assert rel_err(grads.data, num) <= TOL


def test_embedding_gradient_large_vocab_path() -> None:
    # More ids than table rows uses the one-hot path, fewer uses np.add.at: both must agree.
    emb = Embedding(5, 2)
    _, grads = emb.build(np.float64)
    ids = np.array([4, 4, 1])
    dy = RNG.standard_normal((3, 2))
    emb.forward(ids)
    emb.backward(dy)
    expect = np.zeros((5, 2))
    np.add.at(expect, ids, dy)
    np.testing.assert_allclose(grads["weight"], expect, rtol=1e-14)
    grads.zero_()
    ids = np.array([4, 4, 1, 0, 2, 4])
    dy = RNG.standard_normal((6, 2))
    emb.forward(ids)
    emb.backward(dy)
    expect = np.zeros((5, 2))
    np.add.at(expect, ids, dy)
    np.testing.assert_allclose(grads["weight"], expect, rtol=1e-14)


@pytest.mark.parametrize("normalizer", [None, 17.0])
def test_cross_entropy_gradient(normalizer: float | None) -> None:
    loss = CrossEntropyLoss()
    logits = RNG.standard_normal((2, 3, 5))
    t = RNG.integers(0, 5, (2, 3))
    loss.forward(logits, t, normalizer)
    d = loss.backward()

    def f() -> float:
        out = loss.forward(logits, t, normalizer)
        loss.clear_cache()
        return out

    _, num = numeric_grad(f, logits)
    assert rel_err(d.reshape(-1), num) <= TOL


@pytest.mark.parametrize("normalizer", [None, 9.0])
def test_mse_gradient(normalizer: float | None) -> None:
    loss = MSELoss()
    pred = RNG.standard_normal((4, 3))
    target = RNG.standard_normal((4, 3))
    loss.forward(pred, target, normalizer)
    d = loss.backward()

    def f() -> float:
        out = loss.forward(pred, target, normalizer)
        loss.clear_cache()
        return out

    _, num = numeric_grad(f, pred)
    assert rel_err(d.reshape(-1), num) <= TOL


def test_mlp_model_gradient_through_loss() -> None:
    model = MLP([4, 6, 5, 3], activation="tanh")
    params, grads = model.build(np.float64, seed=1)
    x = RNG.standard_normal((5, 4))
    target = RNG.standard_normal((5, 3))
    loss = MSELoss()
    loss.forward(model.forward(x), target)
    dx = model.backward(loss.backward())

    def f() -> float:
        out = loss.forward(model.forward(x), target)
        model.clear_cache()
        loss.clear_cache()
        return out

    _, num = numeric_grad(f, params.data)
    assert rel_err(grads.data, num) <= TOL
    _, num_x = numeric_grad(f, x)
    assert rel_err(dx.reshape(-1), num_x) <= TOL


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_gpt_model_gradient_through_loss(tie: bool) -> None:
    cfg = GPTConfig(vocab_size=7, block_size=6, n_layer=2, n_head=2, n_embd=8, tie_weights=tie)
    model = GPT(cfg)
    params, grads = model.build(np.float64, seed=2)
    params.data += 0.05 * np.random.default_rng(9).standard_normal(params.data.shape)
    idx = RNG.integers(0, 7, (2, 5))
    tgt = RNG.integers(0, 7, (2, 5))
    loss = CrossEntropyLoss()
    loss.forward(model.forward(idx), tgt)
    assert model.backward(loss.backward()) is None

    def f() -> float:
        out = loss.forward(model.forward(idx), tgt)
        model.clear_cache()
        loss.clear_cache()
        return out

    _, num = numeric_grad(f, params.data)
    assert rel_err(grads.data, num) <= TOL


def test_gradcheck_helper_detects_a_wrong_gradient() -> None:
    class Broken(Linear):
        def backward(self, dy: np.ndarray, ctx: object = None) -> np.ndarray:
            return 1.01 * super().backward(dy, ctx)

    with pytest.raises(AssertionError, match="input gradient"):
        check_module(Broken(3, 2), RNG.standard_normal((2, 3)))


def test_flatbuffer_views_receive_gradients() -> None:
    lin = Linear(3, 2)
    params = FlatBuffer(lin.named_parameter_shapes(), np.float64)
    grads = params.like()
    lin.bind(params.views(), grads.views())
    lin.init_parameters(0)
    lin.forward(np.ones((1, 3)))
    lin.backward(np.ones((1, 2)))
    np.testing.assert_array_equal(grads.data, np.ones(8))
