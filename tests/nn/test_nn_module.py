"""Module contract: names, bind/unbind, deterministic init, units, contexts, dtypes, errors."""

from __future__ import annotations

import numpy as np
import pytest

from mpidist.core.buffers import FlatBuffer
from mpidist.nn import (
    GPT,
    MLP,
    CrossEntropyLoss,
    Embedding,
    GPTConfig,
    LayerNorm,
    Linear,
    MSELoss,
    UnboundParameterError,
    init_slice,
    init_value,
)

CFG = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)


def tokens(b: int = 2, t: int = 6, v: int = 11, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, v, (b, t)), rng.integers(0, v, (b, t))


# -- names and layout ---------------------------------------------------------------------
def test_gpt_parameter_names_and_units() -> None:
    model = GPT(CFG)
    names = [n for n, _ in model.named_parameter_shapes()]
    assert names[:2] == ["embed.wte.weight", "embed.wpe.weight"]
    assert "blocks.0.attn.qkv.weight" in names
    assert "blocks.1.mlp.proj.bias" in names
    assert names[-1] == "final.head.weight"
    assert len(names) == len(set(names))
    assert len(model.units) == CFG.n_layer + 2
    # The units' parameters partition the model's, in order.
    unit_names = [n for u in model.units for n, _ in u.named_parameter_shapes()]
    assert unit_names == names
    assert dict(model.named_parameter_shapes())["blocks.0.attn.qkv.weight"] == (8, 24)


def test_mlp_names_and_units() -> None:
    model = MLP([3, 5, 2])
    assert model.named_parameter_shapes() == [
        ("layers.0.weight", (3, 5)),
        ("layers.0.bias", (5,)),
        ("layers.1.weight", (5, 2)),
        ("layers.1.bias", (2,)),
    ]
    assert len(model.units) == 2
    assert model.num_parameters() == 3 * 5 + 5 + 5 * 2 + 2


def test_tied_weights_share_one_tensor() -> None:
    model = GPT(GPTConfig(**{**CFG.__dict__, "tie_weights": True}))
    names = [n for n, _ in model.named_parameter_shapes()]
    assert "final.head.weight" not in names
    assert model.final.parameter_names() == [
        "final.ln_f.weight", "final.ln_f.bias", "embed.wte.weight"
    ]
    assert model.final.parameter_names(include_shared=False) == [
        "final.ln_f.weight", "final.ln_f.bias"
    ]
    params, grads = model.build()
    assert model.final.head.weight is not None
    assert np.shares_memory(model.final.head.param("weight"), params["embed.wte.weight"])
    x, y = tokens()
    loss = CrossEntropyLoss()
    loss.forward(model.forward(x), y)
    model.backward(loss.backward())
    # The embedding gradient holds both uses: rows of tokens never seen as input still get
    # gradient from the head.
    unused = sorted(set(range(11)) - set(x.ravel().tolist()))
    if unused:
        assert np.any(grads["embed.wte.weight"][unused[0]] != 0)


# -- bind / unbind ------------------------------------------------------------------------
def test_unbound_forward_raises_clear_error() -> None:
    model = GPT(CFG)
    with pytest.raises(UnboundParameterError, match="embed.wte.weight.*not bound"):
        model.forward(tokens()[0])
    params, _ = model.build()
    model.forward(tokens()[0])
    model.unbind()
    assert not model.is_bound
    with pytest.raises(UnboundParameterError, match="not bound"):
        model.forward(tokens()[0])
    model.bind(params)  # parameters only: forward works, backward cannot accumulate
    out = model.forward(tokens()[0])
    with pytest.raises(UnboundParameterError, match="gradient of 'final.head.weight'"):
        model.backward(np.ones_like(out))


def test_bind_validates_names_shapes_and_dtypes() -> None:
    lin = Linear(3, 2)
    with pytest.raises(ValueError, match="'weight' is missing"):
        lin.bind({"bias": np.zeros(2)})
    with pytest.raises(ValueError, match=r"'weight' has shape \(2, 3\), expected \(3, 2\)"):
        lin.bind({"weight": np.zeros((2, 3)), "bias": np.zeros(2)})
    with pytest.raises(ValueError, match="dtype float32"):
        lin.bind(
            {"weight": np.zeros((3, 2)), "bias": np.zeros(2)},
            {"weight": np.zeros((3, 2), np.float32), "bias": np.zeros(2, np.float32)},
        )
    # A failed bind leaves the module unbound; extra names are ignored.
    assert not lin.is_bound
    lin.bind({"weight": np.zeros((3, 2)), "bias": np.zeros(2), "other": np.zeros(1)})
    assert lin.is_bound


def test_backward_without_forward_raises() -> None:
    lin = Linear(3, 2)
    lin.build()
    with pytest.raises(RuntimeError, match="no matching forward"):
        lin.backward(np.ones((1, 2)))
    lin.forward(np.ones((1, 3)))
    lin.backward(np.ones((1, 2)))
    with pytest.raises(RuntimeError, match="no matching forward"):
        lin.backward(np.ones((1, 2)))


def test_units_run_one_at_a_time_like_zero3() -> None:
    """Gather one unit into a working buffer, run it, free it: same loss and gradients."""
    model = GPT(CFG)
    params, grads = model.build(seed=4)
    x, y = tokens(seed=1)
    loss = CrossEntropyLoss()
    ref_loss = loss.forward(model.forward(x), y)
    model.backward(loss.backward())
    ref_grads = grads.data.copy()

    model.unbind()
    got_grads = grads.like()
    full = params.views()

    def gather(unit):
        specs = [(n, full[n].shape) for n in unit.parameter_names()]
        work, gwork = FlatBuffer(specs, params.dtype), FlatBuffer(specs, params.dtype)
        for n in work:
            work[n][...] = full[n]
        unit.bind(work, gwork)
        return gwork

    h = x
    for unit in model.units:
        gather(unit)
        h = unit.forward(h, ctx="mb0")
        unit.unbind()  # ZeRO-3 frees the full copy; the activations stay cached
    got_loss = loss.forward(h, y)
    d = loss.backward()
    for unit in reversed(model.units):
        gwork = gather(unit)
        d = unit.backward(d, ctx="mb0")
        unit.unbind()
        for n in gwork:
            got_grads[n][...] += gwork[n]  # stands in for reduce-scatter into the shard
    assert got_loss == pytest.approx(ref_loss, rel=1e-14)
    np.testing.assert_allclose(got_grads.data, ref_grads, rtol=1e-12, atol=1e-15)


def test_unbind_keeps_activations_and_clear_cache_drops_them() -> None:
    lin = Linear(2, 2)
    params, grads = lin.build()
    lin.forward(np.ones((1, 2)), ctx="a")
    lin.unbind()
    lin.bind(params, grads)
    lin.backward(np.ones((1, 2)), ctx="a")
    lin.forward(np.ones((1, 2)), ctx="b")
    lin.clear_cache()
    with pytest.raises(RuntimeError, match="ctx='b' has no matching forward"):
        lin.backward(np.ones((1, 2)), ctx="b")


# -- contexts and accumulation ------------------------------------------------------------
def test_interleaved_micro_batches_with_ctx_match_sequential() -> None:
    model = GPT(CFG)
    params, grads = model.build(seed=5)
    loss = CrossEntropyLoss()
    mbs = [tokens(seed=s) for s in range(3)]
    total = 3 * mbs[0][1].size
    for x, y in mbs:
        loss.forward(model.forward(x), y, normalizer=total)
        model.backward(loss.backward())
    ref = grads.data.copy()
    grads.zero_()
    # All forwards first (like a pipeline warm-up), then backwards in another order.
    for i, (x, y) in enumerate(mbs):
        loss.forward(model.forward(x, ctx=i), y, normalizer=total, ctx=i)
    for i in (2, 0, 1):
        model.backward(loss.backward(ctx=i), ctx=i)
    np.testing.assert_allclose(grads.data, ref, rtol=1e-12, atol=1e-15)


def test_micro_batch_accumulation_with_global_normalizer_equals_full_batch() -> None:
    model = MLP([4, 8, 3])
    params, grads = model.build(seed=0)
    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((12, 4)), rng.standard_normal((12, 3))
    loss = MSELoss()
    full = loss.forward(model.forward(x), t)
    model.backward(loss.backward())
    ref = grads.data.copy()
    model.zero_grad()
    assert not grads.data.any()
    parts = 0.0
    for sl in (slice(0, 4), slice(4, 8), slice(8, 12)):
        parts += loss.forward(model.forward(x[sl]), t[sl], normalizer=12)
        model.backward(loss.backward())
    assert parts == pytest.approx(full, rel=1e-14)
    np.testing.assert_allclose(grads.data, ref, rtol=1e-13, atol=1e-16)


# -- deterministic initialisation -----------------------------------------------------------
def test_init_value_depends_only_on_seed_and_name() -> None:
    a = init_value("blocks.0.attn.qkv.weight", (4, 5), seed=3)
    b = init_value("blocks.0.attn.qkv.weight", (4, 5), seed=3)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, init_value("blocks.1.attn.qkv.weight", (4, 5), seed=3))
    assert not np.array_equal(a, init_value("blocks.0.attn.qkv.weight", (4, 5), seed=4))
    f32 = init_value("blocks.0.attn.qkv.weight", (4, 5), seed=3, dtype=np.float32)
    assert f32.dtype == np.float32
    np.testing.assert_array_equal(f32, a.astype(np.float32))
    np.testing.assert_array_equal(
        init_slice("x", (6, 4), (slice(None), slice(2, 4)), seed=1),
        init_value("x", (6, 4), seed=1)[:, 2:4],
    )
    u = init_value("u", (1000,), seed=0, kind="uniform", scale=0.5)
    assert u.min() >= -0.5 and u.max() < 0.5
    with pytest.raises(ValueError, match="init kind='bogus'"):
        init_value("x", (2,), 0, kind="bogus")
    with pytest.raises(ValueError, match="seed=-1"):
        init_value("x", (2,), -1)


def test_model_init_is_independent_of_construction_order_and_layout() -> None:
    p1, _ = GPT(CFG).build(seed=7)
    # Build another model first: construction order and other instances must not matter.
    GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=4)).build(seed=7)
    p2, _ = GPT(CFG).build(seed=7, pad_to=3)
    for name in p1:
        np.testing.assert_array_equal(p1[name], p2[name])
    # Each parameter equals its standalone init_value.
    w = init_value("blocks.1.attn.proj.weight", (8, 8), 7, scale=0.02 / np.sqrt(4))
    np.testing.assert_array_equal(p1["blocks.1.attn.proj.weight"], w)
    np.testing.assert_array_equal(p1["blocks.0.ln_1.weight"], np.ones(8))
    np.testing.assert_array_equal(p1["blocks.0.attn.qkv.bias"], np.zeros(24))
    # Different parameters of the same shape differ.
    assert not np.array_equal(p1["blocks.0.attn.proj.weight"], p1["blocks.1.attn.proj.weight"])
    p3, _ = GPT(CFG).build(seed=8)
    assert not np.array_equal(p1.data, p3.data)


def test_gpt2_init_statistics() -> None:
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=64)
    p, _ = GPT(cfg).build(seed=0)
    assert np.std(p["blocks.0.attn.qkv.weight"]) == pytest.approx(0.02, rel=0.05)
    assert np.std(p["blocks.0.mlp.proj.weight"]) == pytest.approx(0.02 / np.sqrt(8), rel=0.05)
    bound = 1 / np.sqrt(3)
    w = MLP([3, 400]).build(seed=0)[0]["layers.0.weight"]
    assert np.abs(w).max() <= bound
    assert np.abs(w).max() > 0.9 * bound


# -- dtypes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dtype_end_to_end(dtype: type) -> None:
    model = GPT(CFG)
    params, grads = model.build(dtype=dtype)
    x, y = tokens()
    logits = model.forward(x)
    assert logits.dtype == dtype
    loss = CrossEntropyLoss()
    value = loss.forward(logits, y)
    assert np.isfinite(value)
    d = loss.backward()
    assert d.dtype == dtype
    model.backward(d)
    assert grads.data.dtype == dtype and np.abs(grads.data).sum() > 0
    mlp = MLP([3, 4, 2])
    mlp.build(dtype=dtype)
    out = mlp.forward(np.ones((2, 3)))  # float64 data into a float32 model is cast once
    assert out.dtype == dtype
    assert mlp.backward(np.ones_like(out)).dtype == dtype


def test_float32_matches_float64() -> None:
    x, y = tokens()
    losses = []
    for dt in (np.float32, np.float64):
        model = GPT(CFG)
        model.build(dtype=dt, seed=1)
        losses.append(CrossEntropyLoss().forward(model.forward(x), y))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_build_rejects_integer_dtype() -> None:
    with pytest.raises(ValueError, match="dtype=int64"):
        Linear(2, 2).build(dtype=np.int64)


# -- bad input --------------------------------------------------------------------------------
def test_gpt_config_validation() -> None:
    with pytest.raises(ValueError, match="n_embd=10 is not divisible by n_head=4"):
        GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=4, n_embd=10)
    with pytest.raises(ValueError, match="n_layer=0"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match="dropout=1.5"):
        GPTConfig(dropout=1.5)


def test_gpt_input_validation() -> None:
    model = GPT(CFG)
    model.build()
    with pytest.raises(ValueError, match="id 11 is out of range for num_embeddings=11"):
        model.forward(np.array([[1, 11]]))
    with pytest.raises(ValueError, match="id -1 is negative"):
        model.forward(np.array([[1, -1]]))
    with pytest.raises(ValueError, match="sequence length 9 exceeds block_size=8"):
        model.forward(np.zeros((1, 9), dtype=np.int64))
    with pytest.raises(ValueError, match=r"shape \(4,\) are not \(batch, time\)"):
        model.forward(np.zeros(4, dtype=np.int64))
    with pytest.raises(ValueError, match="ids must be integers"):
        model.forward(np.zeros((1, 3)))


def test_layer_input_validation() -> None:
    lin = Linear(3, 2)
    lin.build()
    with pytest.raises(ValueError, match=r"\(4, 5\) does not end in in_features=3"):
        lin.forward(np.ones((4, 5)))
    ln = LayerNorm(4)
    ln.build()
    with pytest.raises(ValueError, match="dim=4"):
        ln.forward(np.ones((2, 3)))
    with pytest.raises(ValueError, match="in_features=0"):
        Linear(0, 2)
    emb = Embedding(3, 2)
    emb.build()
    with pytest.raises(ValueError, match="id 3 is out of range"):
        emb.forward(np.array([3]))
    with pytest.raises(ValueError, match="sizes=\\[3\\]"):
        MLP([3])
    with pytest.raises(ValueError, match="activation='swish'"):
        MLP([3, 4, 2], activation="swish")


def test_loss_input_validation() -> None:
    ce = CrossEntropyLoss()
    with pytest.raises(ValueError, match="target 5 is out of range for 5 classes"):
        ce.forward(np.zeros((2, 5)), np.array([0, 5]))
    with pytest.raises(ValueError, match="target -1"):
        ce.forward(np.zeros((2, 5)), np.array([0, -1]))
    with pytest.raises(ValueError, match=r"targets of shape \(3,\) do not match"):
        ce.forward(np.zeros((2, 5)), np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="normalizer=0"):
        ce.forward(np.zeros((2, 5)), np.array([0, 1]), normalizer=0)
    with pytest.raises(ValueError, match="does not match predictions"):
        MSELoss().forward(np.zeros((2, 3)), np.zeros((3, 2)))


def test_cross_entropy_value_and_default_normalizer() -> None:
    ce = CrossEntropyLoss()
    logits = np.zeros((2, 3, 4))
    t = np.zeros((2, 3), dtype=np.int64)
    assert ce.forward(logits, t) == pytest.approx(np.log(4))
    assert ce.forward(logits, t, normalizer=12) == pytest.approx(np.log(4) / 2)
