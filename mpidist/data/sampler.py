"""World-size-invariant batch sampling.

A run is defined by its global batch size ``B`` and seed. Epoch ``e`` visits the samples in
the order of a permutation drawn from ``(seed, e)``; step ``k`` of the epoch takes positions
``[k*B, (k+1)*B)`` of it. Data-parallel rank ``r`` of ``n`` takes a contiguous slice of that
global batch: ``B // n`` samples, one more on the first ``B % n`` ranks (:func:`split_points`),
so concatenating the ranks' slices in rank order gives back the global batch exactly, whatever
``n`` is, and no sample is dropped or repeated when ``n`` does not divide ``B``. Nothing here
communicates.

Up to :data:`PERMUTATION_LIMIT` samples an epoch's order is NumPy's permutation; above it the
order is a keyed pseudo-random permutation computed index by index (a Feistel network over
``[0, n)`` with cycle walking, keyed by ``(seed, epoch)``), so that a data set of billions of
samples costs no memory. Either way it is a pure function of ``(seed, epoch)``.

:class:`WindowSampler` draws each global batch with replacement from ``(seed, step)`` alone
(nanoGPT's way): token files use it, with a sample index being a window's start position.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["PERMUTATION_LIMIT", "GlobalBatchSampler", "WindowSampler", "check_local_sizes",
           "checked_indices", "checked_int", "feistel_permute", "micro_batches", "split_points"]

#: Largest data set whose epoch order is a materialised permutation (8 bytes per sample);
#: larger ones use :func:`feistel_permute`, which needs no memory.
PERMUTATION_LIMIT = 1 << 20

_FEISTEL_ROUNDS = 6
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


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


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def feistel_permute(positions: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """Images of ``positions`` (integers in ``[0, n)``) under a keyed bijection of
    ``[0, n)``: a balanced Feistel network on the smallest even number of bits that holds
    ``n``, applied again to any image that falls outside ``[0, n)`` (cycle walking, at most a
    few times on average since the domain is under ``4 n``). ``keys``: one uint64 per round.
    Pure; O(len(positions)) time and memory."""
    n = checked_int(n, "n", 1)
    x = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    if n == 1:
        return np.zeros(x.shape, dtype=np.int64)
    bits = max(2, int(n - 1).bit_length())
    bits += bits & 1
    half = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    keys = np.asarray(keys, dtype=np.uint64)

    def rounds(v: np.ndarray) -> np.ndarray:
        left, right = v >> half, v & mask
        with np.errstate(over="ignore"):
            for k in keys:
                left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << half) | right

    out = rounds(x)
    bad = out >= np.uint64(n)
    while bad.any():
        out[bad] = rounds(out[bad])
        bad = out >= np.uint64(n)
    return out.astype(np.int64)


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

    def _lazy(self) -> bool:
        return self.shuffle and self.n_samples > PERMUTATION_LIMIT

    def _keys(self, epoch: int) -> np.ndarray:
        seq = np.random.SeedSequence([self.seed, epoch])
        return seq.generate_state(_FEISTEL_ROUNDS, dtype=np.uint64)

    def order(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The samples at ``positions`` (in ``[0, n_samples)``) of epoch ``epoch``'s order:
        ``permutation(epoch)[positions]``, without the whole permutation above
        :data:`PERMUTATION_LIMIT` samples."""
        epoch = checked_int(epoch, "epoch")
        if self._lazy():
            return feistel_permute(positions, self.n_samples, self._keys(epoch))
        return np.take(self.permutation(epoch), positions)

    def permutation(self, epoch: int) -> np.ndarray:
        """Order in which epoch ``epoch`` visits the samples (materialised: 8 bytes per
        sample, also above :data:`PERMUTATION_LIMIT`; :meth:`order` gives a part)."""
        epoch = checked_int(epoch, "epoch")
        if self._lazy():
            return self.order(epoch, np.arange(self.n_samples, dtype=np.int64))
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
        b = self.global_batch_size
        lo, hi = k * b, (k + 1) * b
        if self._lazy():
            return self.order(epoch, np.arange(lo, hi, dtype=np.int64) % self.n_samples)
        perm = self.permutation(epoch)
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


class WindowSampler(GlobalBatchSampler):
    """Global batches drawn with replacement: step ``s``'s ``B`` samples are uniform integers
    in ``[0, n_samples)`` from ``SeedSequence([seed, s])`` (nanoGPT's way of sampling a token
    stream: no permutation of billions of positions, and resuming needs only the step).

    The same interface as :class:`GlobalBatchSampler` (each data-parallel rank's slice,
    ``state_dict``); an "epoch" is ``n_samples // B`` steps, for the record only. Pure, not
    collective. ``reweight`` (default False): the data may have changed since the state
    :meth:`load_state_dict` is given was saved (``--data-reweight``): its step is taken,
    its size not compared.
    """

    def __init__(self, n_samples: int, global_batch_size: int, seed: int = 0) -> None:
        n = checked_int(n_samples, "n_samples")
        if n == 0:
            raise ValueError("n_samples=0: the dataset is empty")
        super().__init__(max(n, checked_int(global_batch_size, "global_batch_size")),
                         global_batch_size, seed, drop_last=True)
        self.n_samples = n
        self.reweight = False

    @property
    def steps_per_epoch(self) -> int:
        """``n_samples // B`` steps (at least 1): a nominal epoch."""
        return max(1, self.n_samples // self.global_batch_size)

    def global_indices(self, step: int) -> np.ndarray:
        """Sample indices of global step ``step``: drawn with replacement from ``(seed,
        step)``."""
        step = checked_int(step, "step")
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, step]))
        return rng.integers(0, self.n_samples, size=self.global_batch_size, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:  # pragma: no cover - not meaningful
        raise TypeError("a WindowSampler draws with replacement: it has no permutation")

    def state_dict(self) -> dict[str, Any]:
        """As :meth:`GlobalBatchSampler.state_dict`, with ``replacement: True``."""
        return {**super().state_dict(), "replacement": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s step; ValueError if it came from a sampler without
        replacement or another run shape."""
        if not state.get("replacement", False):
            raise ValueError("sampler state is of a sampler without replacement (a text "
                             "corpus); this run samples a token file with replacement")
        if self.reweight:
            state = {k: v for k, v in state.items() if k not in ("n_samples", "epoch")}
        super().load_state_dict(state)

    def __repr__(self) -> str:
        return (f"WindowSampler(n_samples={self.n_samples}, global_batch_size="
                f"{self.global_batch_size}, seed={self.seed}, step={self.step})")
