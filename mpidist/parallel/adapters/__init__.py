"""Bring your own model: train models from other frameworks with mpidist's strategies.

:class:`FunctionalModel` takes any framework: a dict of NumPy parameters and a
``loss_and_grad(params, batch) -> (loss, grads)`` function (``FunctionalOptimizer``).
PyTorch users keep their own training loop with :mod:`mpidist.torch` instead.

It exposes the mpidist module protocol (``named_parameter_shapes``, ``parameter_names``,
``bind``, ``unbind``, ``init_parameters``, ``forward``, ``backward``), so ``DDPOptimizer``,
``ZeRO1Optimizer`` and ``ZeRO2Optimizer`` run them unchanged: parameters and gradients live in
the strategies' flat buffers, gradients are synchronised over MPI and parameters are updated
by mpidist's fused kernels.
"""

from __future__ import annotations

from mpidist.parallel.adapters.common import Trainer, make_optimizer
from mpidist.parallel.adapters.functional import (
    FunctionalLoss,
    FunctionalModel,
    FunctionalOptimizer,
)

__all__ = [
    "FunctionalLoss",
    "FunctionalModel",
    "FunctionalOptimizer",
    "Trainer",
    "make_optimizer",
]

