"""Shared pieces of the strategy tests: models, data and the single-process reference."""

from __future__ import annotations

import numpy as np

from mpidist.data import GlobalBatchSampler, TextCorpus, synthetic_regression
from mpidist.nn import GPT, MLP, CrossEntropyLoss, GPTConfig, MSELoss
from mpidist.optim import SGD, AdamW

GPT_CONFIG = GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=16)

_CORPUS: dict[int, TextCorpus] = {}


def make_case(kind: str, gpt: GPTConfig = GPT_CONFIG):
    """(model factory, dataset, loss, optimizer factory) for 'gpt' (of config ``gpt``) or
    'mlp'."""
    if kind == "gpt":
        if gpt.block_size not in _CORPUS:
            _CORPUS[gpt.block_size] = TextCorpus(gpt.block_size)
        return (lambda: GPT(gpt)), _CORPUS[gpt.block_size], CrossEntropyLoss(), \
            (lambda: AdamW(lr=3e-3, weight_decay=0.1))
    if kind == "mlp":
        data = synthetic_regression(96, 7, 3, seed=1)
        return (lambda: MLP([7, 13, 11, 3])), data, MSELoss(), \
            (lambda: SGD(lr=0.05, momentum=0.9, nesterov=True))
    raise ValueError(kind)


_RUNS: dict[tuple, tuple[np.ndarray, dict[str, np.ndarray]]] = {}


def reference_run(kind: str, steps: int, global_batch: int, dtype: str,
                  max_grad_norm: float | None = None, gpt: GPTConfig = GPT_CONFIG):
    """Plain single-process training on the whole global batch: losses and final params
    (computed once per arguments; read them, don't change them)."""
    key = (kind, steps, global_batch, dtype, max_grad_norm, gpt)
    if key not in _RUNS:
        _RUNS[key] = _train_alone(*key)
    return _RUNS[key]


def _train_alone(kind, steps, global_batch, dtype, max_grad_norm, gpt):
    make_model, data, loss, make_opt = make_case(kind, gpt)
    model = make_model()
    params, grads = model.build(np.dtype(dtype), seed=0)
    opt = make_opt()
    state = opt.init_state(params.data.shape[0], dtype=np.dtype(dtype))
    sampler = GlobalBatchSampler(len(data), global_batch, seed=0)
    losses = []
    for step in range(steps):
        x, y = data.batch(sampler.global_indices(step))
        grads.zero_()
        out = model.forward(x)
        losses.append(loss.forward(out, y))
        model.backward(loss.backward())
        scale = 1.0
        if max_grad_norm is not None:
            norm = float(np.sqrt(np.dot(grads.data.astype(np.float64), grads.data)))
            scale = min(1.0, max_grad_norm / (norm + 1e-6))
        opt.update(params.data, grads.data, state, grad_scale=scale)
    return np.array(losses), {n: v.copy() for n, v in params.views().items()}


def sampled_steps(opt, model, data, steps: int, batch: int, check=None) -> np.ndarray:
    """``steps`` steps of ``opt`` on ``model`` with the global batches of a
    :class:`GlobalBatchSampler` (seed 0) over ``data``, ``check(opt)`` after each; the
    losses."""
    opt.sampler = GlobalBatchSampler(len(data), batch, seed=0)
    losses = []
    for _ in range(steps):
        x, y = data.batch(opt.sampler.next_local(model.dp_rank, model.dp_size))
        losses.append(opt.step(model, (x, y)))
        if check is not None:
            check(opt)
    return np.array(losses)
