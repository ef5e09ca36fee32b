"""Bring your own model: train models from other frameworks with mpidist's strategies.

* :mod:`mpidist.adapters.torch` wraps a CPU ``torch.nn.Module`` (``wrap_torch``); torch is an
  optional extra (``pip install mpidist[torch]``) and is imported only when that submodule is.
* :class:`FunctionalModel` takes any framework: a dict of NumPy parameters and a
  ``loss_and_grad(params, batch) -> (loss, grads)`` function (``FunctionalOptimizer``).

Both expose the mpidist module protocol (``named_parameter_shapes``, ``parameter_names``,
``bind``, ``unbind``, ``init_parameters``, ``forward``, ``backward``), so ``DDPOptimizer``,
``ZeRO1Optimizer`` and ``ZeRO2Optimizer`` run them unchanged: parameters and gradients live in
the strategies' flat buffers, gradients are synchronised over MPI and parameters are updated
by mpidist's fused kernels.
"""

from __future__ import annotations

from typing import Any

from mpidist.adapters.common import Trainer, make_optimizer
from mpidist.adapters.functional import FunctionalLoss, FunctionalModel, FunctionalOptimizer

__all__ = [
    "FunctionalLoss",
    "FunctionalModel",
    "FunctionalOptimizer",
    "Trainer",
    "make_optimizer",
    "wrap_torch",
]


def wrap_torch(*args: Any, **kwargs: Any) -> Trainer:
    """``mpidist.adapters.torch.wrap_torch`` (imports torch on first use)."""
    from mpidist.adapters.torch import wrap_torch as _wrap

    return _wrap(*args, **kwargs)
