"""Losses with the world-size-invariant convention: sum over samples divided by a normaliser.

``loss.forward(outputs, targets, normalizer=N)`` returns ``sum_i loss_i / N``; the default
``N`` is the number of samples (tokens, for a language model) in the call, i.e. the mean.
A data-parallel rank passes the *global* count, so the sum of the ranks' losses (and of their
gradients) equals the loss (and gradient) of the whole global batch on one process.
``backward()`` returns the gradient of that value with respect to the outputs, in their dtype.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from mpidist.core.arrays import as_array, as_like, namespace

from . import fused as F
from .module import Module

__all__ = ["CrossEntropyLoss", "MSELoss"]


def resolve_normalizer(normalizer: float | None, count: int) -> float:
    """``normalizer`` (default ``count``) as a float; ValueError unless it is > 0."""
    n = float(count if normalizer is None else normalizer)
    if not n > 0:
        raise ValueError(f"normalizer={normalizer!r} must be > 0")
    return n


def check_targets(targets: object, logits_shape: tuple[int, ...], n_classes: int) -> np.ndarray:
    """``targets`` as an integer array shaped like the logits without their last axis, with
    values in ``[0, n_classes)``; ValueError naming the bad shape, dtype or value. Pure."""
    targets = as_array(targets)
    if targets.shape != logits_shape[:-1]:
        raise ValueError(
            f"targets of shape {targets.shape} do not match logits of shape {logits_shape}"
        )
    if targets.dtype.kind not in "iu":
        raise ValueError(f"targets must be integers, got dtype {targets.dtype}")
    if targets.size:
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= n_classes:
            raise ValueError(f"target {lo if lo < 0 else hi} is out of range for "
                             f"{n_classes} classes")
    return targets


class CrossEntropyLoss(Module):
    """Softmax cross-entropy of logits ``(..., V)`` against integer targets ``(...)``.

    ``forward(logits, targets, normalizer=None, ctx=None) -> float`` computes
    ``sum(-log softmax(logits)[target]) / normalizer`` (default normaliser: number of targets).
    """

    def forward(self, logits: np.ndarray, targets: np.ndarray,  # type: ignore[override]
                normalizer: float | None = None, ctx: Hashable = None) -> float:
        logits = as_array(logits)
        if logits.dtype.kind != "f" or logits.ndim < 1:
            raise ValueError(f"logits of shape {logits.shape}, dtype {logits.dtype} are not float")
        v = logits.shape[-1]
        targets = check_targets(targets, logits.shape, v)
        norm = resolve_normalizer(normalizer, targets.size)
        z = logits.reshape(-1, v)
        t = as_like(z, targets.reshape(-1))
        total, lse = F.cross_entropy(z, t)
        # Keeps the logits (not the probabilities): backward recomputes them from the
        # log-sum-exp, so the logits must not be changed in place before backward.
        self._save(ctx, (z, t, lse, norm, logits.shape))
        return total / norm

    def backward(self, dy: float = 1.0, ctx: Hashable = None) -> np.ndarray:  # type: ignore[override]
        """Gradient of ``dy * loss`` with respect to the logits (``dy`` defaults to 1)."""
        z, t, lse, norm, shape = self._take(ctx)
        return F.cross_entropy_backward(z, t, lse, float(dy) / norm).reshape(shape)


class MSELoss(Module):
    """Mean squared error per sample, summed over samples and divided by the normaliser.

    The per-sample loss is the mean over the last (feature) axis of ``(pred - target)^2``;
    with the default normaliser (number of samples) this equals ``torch.nn.MSELoss()``.
    A 1-D ``pred`` is one feature per sample.
    """

    def forward(self, pred: np.ndarray, target: np.ndarray,  # type: ignore[override]
                normalizer: float | None = None, ctx: Hashable = None) -> float:
        pred = as_array(pred)
        if pred.dtype.kind != "f":
            raise ValueError(f"predictions of dtype {pred.dtype} are not float")
        target = as_like(pred, target)
        if target.shape != pred.shape:
            raise ValueError(
                f"target of shape {target.shape} does not match predictions of shape {pred.shape}"
            )
        n_features = pred.shape[-1] if pred.ndim > 1 else 1
        n_samples = pred.size // max(1, n_features)
        norm = resolve_normalizer(normalizer, n_samples)
        diff = pred - target.astype(pred.dtype, copy=False)
        self._save(ctx, (diff, norm * n_features))
        return float(namespace(diff).sum(diff * diff, dtype=np.float64)) / (norm * n_features)

    def backward(self, dy: float = 1.0, ctx: Hashable = None) -> np.ndarray:  # type: ignore[override]
        """Gradient of ``dy * loss`` with respect to the predictions (``dy`` defaults to 1)."""
        diff, denom = self._take(ctx)
        return diff * (2.0 * float(dy) / denom)
