"""Models learn: the GPT overfits a tiny batch, the MLP fits synthetic data, generation runs."""

from __future__ import annotations

import numpy as np

from mpidist.data import TextCorpus, synthetic_classification, synthetic_regression
from mpidist.nn import GPT, MLP, CrossEntropyLoss, GPTConfig, MSELoss


def adam(params: np.ndarray, grads: np.ndarray, lr: float):
    """A minimal Adam on the flat buffer, enough to show the gradients point the right way."""
    m = np.zeros_like(params)
    v = np.zeros_like(params)
    t = 0

    def step() -> None:
        nonlocal t
        t += 1
        m[...] = 0.9 * m + 0.1 * grads
        v[...] = 0.999 * v + 0.001 * grads * grads
        mhat = m / (1 - 0.9**t)
        vhat = v / (1 - 0.999**t)
        params[...] -= lr * mhat / (np.sqrt(vhat) + 1e-8)

    return step


def test_gpt_overfits_a_tiny_batch() -> None:
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg)
    params, grads = model.build(np.float64, seed=0)
    corpus = TextCorpus(block_size=16)
    x, y = corpus.batch(np.arange(4))
    loss_fn = CrossEntropyLoss()
    step = adam(params.data, grads.data, lr=3e-3)
    losses = []
    for _ in range(150):
        model.zero_grad()
        losses.append(loss_fn.forward(model.forward(x), y))
        model.backward(loss_fn.backward())
        step()
    assert losses[0] > 4.5  # about log(256) at init
    assert losses[-1] < 0.05 * losses[0], losses[::25]


def test_gpt_float32_trains_too() -> None:
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, tie_weights=True)
    model = GPT(cfg)
    params, grads = model.build(np.float32, seed=1)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 32, (4, 8))
    y = np.roll(x, -1, axis=1)
    loss_fn = CrossEntropyLoss()
    step = adam(params.data, grads.data, lr=1e-2)
    first = last = 0.0
    for i in range(60):
        model.zero_grad()
        last = loss_fn.forward(model.forward(x), y)
        first = last if i == 0 else first
        model.backward(loss_fn.backward())
        step()
    assert params.data.dtype == np.float32
    assert last < 0.3 * first


def test_mlp_fits_regression_and_classification() -> None:
    data = synthetic_regression(256, 4, 2, seed=0)
    model = MLP([4, 32, 2], activation="tanh")
    params, grads = model.build(seed=0)
    loss_fn = MSELoss()
    step = adam(params.data, grads.data, lr=1e-2)
    x, y = data.batch(np.arange(256))
    first = loss_fn.forward(model.forward(x), y)
    loss_fn.clear_cache()
    for _ in range(200):
        model.zero_grad()
        loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())
        step()
    assert loss_fn.forward(model.forward(x), y) < 0.1 * first

    cls = synthetic_classification(200, 5, 3, seed=1)
    model = MLP([5, 16, 3])
    params, grads = model.build(seed=1)
    ce = CrossEntropyLoss()
    step = adam(params.data, grads.data, lr=1e-2)
    x, y = cls.batch(np.arange(200))
    for _ in range(100):
        model.zero_grad()
        ce.forward(model.forward(x), y)
        model.backward(ce.backward())
        step()
    accuracy = np.mean(model.forward(x).argmax(-1) == y)
    assert accuracy > 0.9


def test_generate_appends_tokens_and_leaves_no_cache() -> None:
    model = GPT(GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=1, n_embd=8))
    model.build(seed=0)
    prompt = TextCorpus.encode("def ")[None, :]
    out = model.generate(prompt, 10, temperature=1.0, seed=3, top_k=5)
    assert out.shape == (1, 14)
    np.testing.assert_array_equal(out[:, :4], prompt)
    np.testing.assert_array_equal(out, model.generate(prompt, 10, temperature=1.0, seed=3, top_k=5))
    greedy = model.generate(prompt, 10, temperature=0)
    assert greedy.shape == (1, 14)
    assert all(not m._cache for _, m in model.named_modules())
    assert isinstance(TextCorpus.decode(out[0]), str)
