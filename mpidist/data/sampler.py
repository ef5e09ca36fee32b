"""World-size-invariant batch sampling.

A run is defined by its global batch size ``B`` and seed. Epoch ``e`` visits the samples in
the order of a permutation drawn from ``(seed, e)``; step ``k`` of the epoch takes positions
``[k*B, (k+1)*B)`` of it. Data-parallel rank ``r`` of ``n`` takes a contiguous slice of that
global batch: ``B // n`` samples, one more on the first ``B % n`` ranks (:func:`split_points`),
so concatenating the ranks' slices in rank order gives back the global batch exactly, whatever
``n`` is, and no sample is dropped or repeated when ``n`` does not divide ``B``. Nothing here
communicates.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["GlobalBatchSampler", "check_local_sizes", "checked_indices", "checked_int",
           "micro_batches", "split_points"]


def checked_int(value: object, what: str, minimum: int = 0) -> int:
    """``value`` as an int; ValueError naming ``what`` unless it is an integer (not a bool)
    of at least ``minimum`` (0 or 1). Pure."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        kind = "a positive" if minimum == 1 else "a non-negative"
        raise ValueError(f"{what}={value!r} must be {kind} integer")
    return int(value)


def checked_indices(indices: Any, n: int) -> np.ndarray:
    """``indices`` as an int64 array; ValueError unless they are integers in ``[0, n)``."""
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu":
        raise ValueError(f"sample indices must be integers, got dtype {idx.dtype}")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        bad = int(idx.min()) if idx.min() < 0 else int(idx.max())
        raise ValueError(f"sample index {bad} is out of range for {n} samples")
    return idx.astype(np.int64, copy=False)


def split_points(n: int, parts: int) -> list[int]:
    """Boundaries ``[0, ..., n]`` of ``parts`` contiguous pieces of ``n`` items whose sizes
    differ by at most one: ``n // parts`` each, one more for the first ``n % parts``. Pure.

    Raises ValueError when ``parts`` is not a positive integer or exceeds ``n`` (a piece
    would be empty).
    """
    n, parts = checked_int(n, "n"), checked_int(parts, "parts", 1)
    if parts > n:
        raise ValueError(f"{n} items cannot be split into {parts} non-empty parts")
    q, r = divmod(n, parts)
    return [i * q + min(i, r) for i in range(parts + 1)]


def check_local_sizes(sizes: Any, m: int) -> None:
    """Raise ValueError unless every data-parallel rank's local batch (``sizes[r]`` samples)
    has at least ``m`` samples, one per micro-batch. Pure; the message names the rank."""
    sizes = np.asarray(sizes, dtype=np.int64)
    r = int(np.argmin(sizes))
    if sizes[r] < max(int(m), 1):
        raise ValueError(
            f"data-parallel rank {r} has a local batch of {int(sizes[r])} samples, fewer than "
            f"micro_batches={m} (each micro-batch needs at least one sample)"
        )


def micro_batches(indices: np.ndarray, m: int) -> list[np.ndarray]:
    """Split ``indices`` into ``m`` contiguous parts whose sizes differ by at most one
    (:func:`split_points`); ValueError if ``m`` is not positive or exceeds ``len(indices)``."""
    m = checked_int(m, "number of micro-batches m", 1)
    n = len(indices)
    if n < m:
        raise ValueError(f"a batch of {n} samples cannot be split into m={m} non-empty "
                         "micro-batches")
    cuts = split_points(n, m)
    return [indices[cuts[i]:cuts[i + 1]] for i in range(m)]


class GlobalBatchSampler:
    """Global batches of sample indices that do not depend on the number of ranks.

    Args:
        n_samples: dataset size.
        global_batch_size: samples per optimizer step, over all data-parallel ranks.
        seed: permutation seed; epoch ``e`` uses ``SeedSequence([seed, e])``.
        drop_last: drop the incomplete last batch of each epoch. With ``False`` the last batch
            is filled up by wrapping around to the start of the same epoch's permutation, so
            every batch has exactly ``global_batch_size`` samples.
        shuffle: permute each epoch (``False``: samples in index order, for evaluation).

    ``step`` below is the global optimizer step counted from the start of the run (epochs
    follow one another). The sampler also keeps a position (epoch, step, samples_seen) that
    iteration advances and :meth:`state_dict` / :meth:`load_state_dict` save and restore.
    """

    def __init__(
        self,
        n_samples: int,
        global_batch_size: int,
        seed: int = 0,
        drop_last: bool = True,
        *,
        shuffle: bool = True,
    ) -> None:
        self.n_samples = checked_int(n_samples, "n_samples")
        self.global_batch_size = checked_int(global_batch_size, "global_batch_size")
        if self.global_batch_size == 0:
            raise ValueError("global_batch_size=0 must be a positive integer")
        self.seed = checked_int(seed, "seed")
        self.drop_last = bool(drop_last)
        self.shuffle = bool(shuffle)
        if self.drop_last and self.n_samples < self.global_batch_size:
            raise ValueError(
                f"n_samples={self.n_samples} is smaller than global_batch_size="
                f"{self.global_batch_size}, so drop_last=True leaves no batch"
            )
        if self.n_samples == 0:
            raise ValueError("n_samples=0: the dataset is empty")
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)
        self.step = 0  # next global step the iterator yields

    # -- pure functions of (seed, step) ------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch."""
        b = self.global_batch_size
        return self.n_samples // b if self.drop_last else -(-self.n_samples // b)

    def epoch_of(self, step: int) -> int:
        """The epoch global step ``step`` belongs to."""
        return checked_int(step, "step") // self.steps_per_epoch

    def permutation(self, epoch: int) -> np.ndarray:
        """Order in which epoch ``epoch`` visits the samples."""
        epoch = checked_int(epoch, "epoch")
        if epoch != self._perm_epoch:
            if self.shuffle:
                rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
                self._perm = rng.permutation(self.n_samples).astype(np.int64)
            else:
                self._perm = np.arange(self.n_samples, dtype=np.int64)
            self._perm_epoch = epoch
        return self._perm

    def global_indices(self, step: int) -> np.ndarray:
        """Sample indices of global step ``step`` (``global_batch_size`` of them)."""
        step = checked_int(step, "step")
        spe = self.steps_per_epoch
        epoch, k = divmod(step, spe)
        perm = self.permutation(epoch)
        b = self.global_batch_size
        lo, hi = k * b, (k + 1) * b
        if hi <= self.n_samples:
            return perm[lo:hi].copy()
        # Last batch with drop_last=False: wrap around within the epoch's permutation.
        return np.take(perm, np.arange(lo, hi) % self.n_samples)

    def check_dp_size(self, dp_size: int) -> int:
        """Validate that ``dp_size`` ranks can each get at least one sample of every global
        batch. Any size up to the global batch works: the slices differ by at most one."""
        dp_size = checked_int(dp_size, "dp_size", 1)
        if dp_size > self.global_batch_size:
            raise ValueError(
                f"global batch size B={self.global_batch_size} is smaller than dp_size="
                f"{dp_size}: every data-parallel rank needs at least one sample"
            )
        return dp_size

    def local_indices(self, step: int, dp_rank: int, dp_size: int) -> np.ndarray:
        """Rank ``dp_rank``'s contiguous slice of global step ``step``: ``B // dp_size``
        samples, one more on the first ``B % dp_size`` ranks."""
        dp_size = self.check_dp_size(dp_size)
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, (int, np.integer)):
            raise ValueError(f"dp_rank={dp_rank!r} must be an integer")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside a data-parallel group of {dp_size}")
        cuts = split_points(self.global_batch_size, dp_size)
        return self.global_indices(step)[cuts[dp_rank]:cuts[dp_rank + 1]]

    micro_batches = staticmethod(micro_batches)

    # -- position and iteration --------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """Epoch of the next step."""
        return self.step // self.steps_per_epoch

    @property
    def samples_seen(self) -> int:
        """Samples consumed so far (steps taken times the global batch size)."""
        return self.step * self.global_batch_size

    def __iter__(self) -> Iterator[np.ndarray]:
        """Yield global batches from the current position on, forever; advances the position."""
        while True:
            yield self.next_global()

    def next_global(self) -> np.ndarray:
        """The global batch at the current position; advances the position by one step."""
        out = self.global_indices(self.step)
        self.step += 1
        return out

    def next_local(self, dp_rank: int, dp_size: int) -> np.ndarray:
        """This rank's slice of the batch at the current position; advances the position."""
        out = self.local_indices(self.step, dp_rank, dp_size)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """Position and identity of the sampler (plain ints/bools: fits JSON and HDF5 attrs)."""
        return {
            "n_samples": self.n_samples,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "step": self.step,
            "samples_seen": self.samples_seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the position in ``state``; ``ValueError`` if it came from another run shape."""
        for key in ("n_samples", "global_batch_size", "seed", "drop_last", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}"
                )
        if "step" not in state:
            raise ValueError("sampler state has no 'step'")
        step = checked_int(state["step"], "step")
        if "epoch" in state and int(state["epoch"]) != step // self.steps_per_epoch:
            raise ValueError(
                f"sampler state epoch={state['epoch']} is inconsistent with step={step} "
                f"({self.steps_per_epoch} steps per epoch)"
            )
        if "samples_seen" in state and int(state["samples_seen"]) != step * self.global_batch_size:
            raise ValueError(
                f"sampler state samples_seen={state['samples_seen']} is inconsistent with "
                f"step={step} and global_batch_size={self.global_batch_size}"
            )
        self.step = step

    def __repr__(self) -> str:
        return (
            f"GlobalBatchSampler(n_samples={self.n_samples}, global_batch_size="
            f"{self.global_batch_size}, seed={self.seed}, drop_last={self.drop_last}, "
            f"step={self.step})"
        )
