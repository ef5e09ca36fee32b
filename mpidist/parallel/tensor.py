"""Tensor parallelism as the sharded component applies it: the plan's styles on a model
(:mod:`mpidist.nn.tp_plan`), and the loss a vocabulary-sharded output needs. Pure."""

from __future__ import annotations

from typing import Any

__all__ = ["check_loss", "tensor_parallel_styles", "vocab_sharded"]


def tensor_parallel_styles(module: Any, plan: Any, tp: int) -> dict[str, Any]:
    """``{layer: style}`` of ``plan`` (default: the model's own) on ``module`` at tensor
    size ``tp``; the one-line ValueError of a plan that does not fit, or splits nothing.
    Pure."""
    from mpidist.nn.tp_plan import check_plan, default_plan

    styles = check_plan(module, plan if plan is not None else default_plan(module), tp)
    if not styles:
        raise ValueError(f"tensor_parallel_size={tp}: the tensor-parallel plan splits no "
                         f"layer of the {type(module).__name__}")
    return styles


def vocab_sharded(module: Any, styles: dict[str, Any]) -> bool:
    """Whether the plan leaves the model's output sharded over the vocabulary (a
    vocab-parallel layer that is not an embedding). Pure."""
    from mpidist.nn.layers import Embedding
    from mpidist.nn.tp_plan import VocabParallel

    layers = dict(module.named_modules())
    return any(isinstance(style, VocabParallel) and not isinstance(layers.get(name), Embedding)
               for name, style in styles.items())


def check_loss(loss: Any, tp: int) -> None:
    """A vocabulary-sharded output needs :class:`CrossEntropyLoss` (computed vocab-parallel);
    ValueError naming the loss otherwise. Pure."""
    from mpidist.nn import CrossEntropyLoss

    if not isinstance(loss, CrossEntropyLoss):
        raise ValueError(f"tensor_parallel_size={tp} needs CrossEntropyLoss (computed "
                         f"vocab-parallel); got {type(loss).__name__}")
