"""Layers with explicit backward, losses and models whose parameters live in flat buffers.

Quick start::

    from mpidist.nn import GPT, GPTConfig, CrossEntropyLoss

    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32))
    params, grads = model.build(dtype=np.float32, seed=0)   # two FlatBuffers, bound
    loss_fn = CrossEntropyLoss()
    loss = loss_fn(model.forward(x), y)                      # mean over tokens by default
    model.backward(loss_fn.backward())                       # grads.data now holds dL/dp

A strategy that needs one unit at a time runs ``model.units`` in order (see
:mod:`mpidist.nn.models`).
"""

from __future__ import annotations

from .allocator import reuse_freed_memory
from .attention import Block, CausalSelfAttention, FeedForward, softmax_lastdim
from .init import init_generator, init_slice, init_value
from .layers import (
    GELU,
    Dense,
    Dropout,
    Embedding,
    Identity,
    LayerNorm,
    Linear,
    ModuleList,
    ReLU,
    Sequential,
    Tanh,
    gelu_tanh,
)
from .losses import CrossEntropyLoss, MSELoss
from .models import GPT, MLP, GPTConfig, GPTEmbedding, GPTHead, LMHead, SequentialModel
from .module import Module, ParamSpec, UnboundParameterError

__all__ = [
    "GELU",
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "CrossEntropyLoss",
    "Dense",
    "Dropout",
    "Embedding",
    "FeedForward",
    "GPTConfig",
    "GPTEmbedding",
    "GPTHead",
    "Identity",
    "LMHead",
    "LayerNorm",
    "Linear",
    "MSELoss",
    "Module",
    "ModuleList",
    "ParamSpec",
    "ReLU",
    "Sequential",
    "SequentialModel",
    "Tanh",
    "UnboundParameterError",
    "gelu_tanh",
    "init_generator",
    "init_slice",
    "init_value",
    "reuse_freed_memory",
    "softmax_lastdim",
]
