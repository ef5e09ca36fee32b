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

from . import fused as F
from .module import Module

__all__ = ["CrossEntropyLoss", "MSELoss"]


def _normalizer(normalizer: float | None, count: int) -> float:
    if normalizer is None:
        normalizer = count
    n = float(normalizer)
    if not n > 0:
        raise ValueError(f"normalizer={normalizer!r} must be > 0")
    return n


class CrossEntropyLoss(Module):
    """Softmax cross-entropy of logits ``(..., V)`` against integer targets ``(...)``.

    ``forward(logits, targets, normalizer=None, ctx=None) -> float`` computes
    ``sum(-log softmax(logits)[target]) / normalizer`` (default normaliser: number of targets).
    """

    def forward(  # type: ignore[override]
        self,
        logits: np.ndarray,
        targets: np.ndarray,
        normalizer: float | None = None,
        ctx: Hashable = None,
    ) -> float:
        logits = np.asarray(logits)
        targets = np.asarray(targets)
        if logits.dtype.kind != "f" or logits.ndim < 1:
            raise ValueError(f"logits of shape {logits.shape}, dtype {logits.dtype} are not float")
        if targets.shape != logits.shape[:-1]:
            raise ValueError(
                f"targets of shape {targets.shape} do not match logits of shape {logits.shape}"
            )
        if targets.dtype.kind not in "iu":
            raise ValueError(f"targets must be integers, got dtype {targets.dtype}")
        v = logits.shape[-1]
        if targets.size:
            lo, hi = int(targets.min()), int(targets.max())
            if lo < 0 or hi >= v:
                bad = lo if lo < 0 else hi
                raise ValueError(f"target {bad} is out of range for {v} classes")
        norm = _normalizer(normalizer, targets.size)
        z = logits.reshape(-1, v)
        t = targets.reshape(-1)
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

    def forward(  # type: ignore[override]
        self,
        pred: np.ndarray,
        target: np.ndarray,
        normalizer: float | None = None,
        ctx: Hashable = None,
    ) -> float:
        pred = np.asarray(pred)
        if pred.dtype.kind != "f":
            raise ValueError(f"predictions of dtype {pred.dtype} are not float")
        target = np.asarray(target)
        if target.shape != pred.shape:
            raise ValueError(
                f"target of shape {target.shape} does not match predictions of shape {pred.shape}"
            )
        n_features = pred.shape[-1] if pred.ndim > 1 else 1
        n_samples = pred.size // max(1, n_features)
        norm = _normalizer(normalizer, n_samples)
        diff = pred - target.astype(pred.dtype, copy=False)
        self._save(ctx, (diff, norm * n_features))
        return float(np.sum(diff * diff, dtype=np.float64)) / (norm * n_features)

    def backward(self, dy: float = 1.0, ctx: Hashable = None) -> np.ndarray:  # type: ignore[override]
        """Gradient of ``dy * loss`` with respect to the predictions (``dy`` defaults to 1)."""
        diff, denom = self._take(ctx)
        return diff * (2.0 * float(dy) / denom)
