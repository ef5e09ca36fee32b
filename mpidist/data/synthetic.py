"""Small synthetic data sets for tests: regression and classification with a batch API.

Both return an :class:`ArrayDataset` whose ``batch(indices) -> (x, y)`` matches
:class:`~mpidist.data.corpus.TextCorpus`, so the samplers and strategies treat them alike.
Values depend only on the arguments (seed included), never on the rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mpidist.data.sampler import checked_indices, checked_int

__all__ = ["ArrayDataset", "synthetic_classification", "synthetic_regression"]


class ArrayDataset:
    """Samples stored as arrays ``x`` (n, ...) and ``y`` (n, ...)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} samples but y has {len(y)}")
        self.x = x
        self.y = y

    def __len__(self) -> int:
        return len(self.x)

    def batch(
        self, indices: Sequence[int] | np.ndarray, dtype: np.dtype | type | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(x[indices], y[indices])``; float parts cast to ``dtype`` when given."""
        idx = checked_indices(indices, len(self.x))
        x, y = self.x[idx], self.y[idx]
        if dtype is not None:
            x = x.astype(dtype)
            if y.dtype.kind == "f":
                y = y.astype(dtype)
        return x, y

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[i], self.y[i]


def synthetic_regression(
    n: int, d_in: int, d_out: int, seed: int = 0, *, noise: float = 0.01
) -> ArrayDataset:
    """``y = tanh(x @ W1) @ W2 + noise`` with Gaussian ``x``: a smooth target an MLP can fit."""
    n = checked_int(n, "n", 1)
    d_in = checked_int(d_in, "d_in", 1)
    d_out = checked_int(d_out, "d_out", 1)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 1]))
    hidden = max(4, d_in)
    w1 = rng.standard_normal((d_in, hidden)) / np.sqrt(d_in)
    w2 = rng.standard_normal((hidden, d_out)) / np.sqrt(hidden)
    x = rng.standard_normal((n, d_in))
    y = np.tanh(x @ w1) @ w2 + noise * rng.standard_normal((n, d_out))
    return ArrayDataset(x, y)


def synthetic_classification(
    n: int, d_in: int, n_classes: int, seed: int = 0, *, separation: float = 2.0
) -> ArrayDataset:
    """Gaussian blobs around ``n_classes`` random centres; int64 labels in ``[0, n_classes)``."""
    n = checked_int(n, "n", 1)
    d_in = checked_int(d_in, "d_in", 1)
    n_classes = checked_int(n_classes, "n_classes", 1)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 2]))
    centres = separation * rng.standard_normal((n_classes, d_in))
    y = rng.integers(0, n_classes, size=n).astype(np.int64)
    x = centres[y] + rng.standard_normal((n, d_in))
    return ArrayDataset(x, y)
