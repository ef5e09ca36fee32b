"""Blends: training on several token files in fixed proportions (Megatron's blended
datasets), the same batches at every world size.

A blend is a list of ``(weight, path)`` sources; the weights are normalized to sum to 1
(``w_i``). Sample number ``g`` of the run (``g = step * B + j`` for the ``j``-th sample of
step ``step``'s global batch of ``B``) comes from source :func:`blend_sources`: the source
``i`` whose interval ``[w_0 + ... + w_{i-1}, w_0 + ... + w_i)`` holds ``frac(g / phi)``
(phi the golden ratio), computed in 64-bit fixed point. This is a deterministic
assignment, independent of the seed and of the world size, by a low-discrepancy sequence:
in the first ``N`` samples, every source's count is within a few samples of ``w_i * N``
(at most 5 for every ``N`` up to 200,000 in the tests, for every weight set tried; the
error grows like ``log N``), and every step's batch holds each source in proportion to
within a few samples (6 for batches of 32 in the tests). Within its source a sample is a
window drawn uniformly with replacement from ``(seed, step)``, as for one token file: the
draws of source 0, then of source 1, ... So
the global batch of a step is a pure function of ``(seed, step)`` and the blend, and a
blend of one source draws exactly what that file alone draws.

A sample index of a blend is ``offset_i + window``, the sources' windows laid end to end
(:class:`BlendedDataset`). Nothing here communicates.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpidist.data.sampler import WindowSampler, checked_indices
from mpidist.data.textfiles import entropy

__all__ = ["BlendSampler", "BlendedDataset", "blend_hash", "blend_sources", "blend_vocabulary",
           "normalized", "open_blend", "parse_blend"]

#: 2^64 / phi, rounded to an odd integer: the step of the Weyl sequence.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _weight(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{where}: weight {value!r} is not a number")
    try:
        w = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: weight {value!r} is not a number (the blend is "
                         "WEIGHT PATH WEIGHT PATH ...)") from None
    if not math.isfinite(w) or w <= 0:
        raise ValueError(f"{where}: weight {value!r} must be a positive number")
    return w


def parse_blend(spec: Any, what: str = "--data-blend") -> list[list[Any]]:
    """The sources of a blend as ``[[weight, path], ...]`` (weights as given, floats).

    ``spec``: the words of ``--data-blend W1 PATH1 W2 PATH2 ...`` (Megatron's
    ``--data-path`` order; each path is one word, so a path may hold any character), or a
    TOML list of tables ``[{path = "...", weight = W}, ...]``, or of ``[W, PATH]`` pairs.
    Pure; raises ValueError naming the bad item.
    """
    if not isinstance(spec, (list, tuple)) or not spec:
        raise ValueError(f"{what}={spec!r} must be a non-empty list of weights and paths")
    out: list[list[Any]] = []
    if all(isinstance(s, dict) for s in spec):
        for i, item in enumerate(spec):
            extra = sorted(set(item) - {"path", "weight"})
            if extra or not isinstance(item.get("path"), str) or "weight" not in item:
                raise ValueError(f"{what}[{i}]={item!r} must be a table with path and "
                                 f"weight only" + (f" (unknown: {extra})" if extra else ""))
            out.append([_weight(item["weight"], f"{what}[{i}]"), item["path"]])
    elif all(isinstance(s, (list, tuple)) for s in spec):
        for i, item in enumerate(spec):
            if len(item) != 2 or not isinstance(item[1], str):
                raise ValueError(f"{what}[{i}]={item!r} must be [weight, path]")
            out.append([_weight(item[0], f"{what}[{i}]"), item[1]])
    else:
        words = list(spec)
        if len(words) % 2:
            raise ValueError(f"{what} {' '.join(map(str, words))}: needs WEIGHT PATH pairs "
                             f"({len(words)} words given)")
        for i in range(0, len(words), 2):
            path = words[i + 1]
            if not isinstance(path, str) or not path:
                raise ValueError(f"{what}: {path!r} after weight {words[i]!r} must be a path")
            out.append([_weight(words[i], f"{what} (source {i // 2 + 1})"), path])
    paths = [p for _, p in out]
    dup = sorted({p for p in paths if paths.count(p) > 1})
    if dup:
        raise ValueError(f"{what}: {dup[0]} is named more than once")
    return out


def normalized(weights: Sequence[float]) -> np.ndarray:
    """The weights divided by their sum (float64)."""
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


def _thresholds(shares: np.ndarray) -> np.ndarray:
    """Upper ends of the first ``K - 1`` intervals in 64-bit fixed point."""
    cum = np.cumsum(shares)[:-1]
    return np.array([min(int(c * 2.0**64), 2**64 - 1) for c in cum], dtype=np.uint64)


def blend_sources(samples: np.ndarray, shares: np.ndarray, *,
                  thresholds: np.ndarray | None = None) -> np.ndarray:
    """The source of each sample number (module docstring); ``shares`` the normalized
    weights (``thresholds``: their fixed-point cuts, when the caller keeps them). Pure."""
    g = np.asarray(samples, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        u = g * _GOLDEN
    if thresholds is None:
        thresholds = _thresholds(np.asarray(shares, dtype=np.float64))
    return np.searchsorted(thresholds, u, side="right").astype(np.int64)


class BlendSampler(WindowSampler):
    """Global batches of a blend (module docstring): ``global_indices(step)`` gives
    ``offset_i + window`` for each of the ``B`` samples. The interface of
    :class:`~mpidist.data.sampler.WindowSampler` (``reweight`` included); pure, not
    collective.
    """

    def __init__(self, sizes: Sequence[int], shares: Sequence[float], global_batch_size: int,
                 seed: int = 0) -> None:
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.shares = np.asarray(shares, dtype=np.float64)
        if len(self.sizes) != len(self.shares) or not len(self.sizes) \
                or (self.sizes < 1).any():
            raise ValueError(f"a blend needs one positive size per weight (sizes "
                             f"{self.sizes.tolist()}, weights {self.shares.tolist()})")
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self._cuts = _thresholds(self.shares)
        super().__init__(int(self.offsets[-1]), global_batch_size, seed=seed)

    def sources(self, step: int) -> np.ndarray:
        """The source of each sample of global step ``step``."""
        b = self.global_batch_size
        return blend_sources(np.arange(step * b, (step + 1) * b, dtype=np.int64), self.shares,
                             thresholds=self._cuts)

    def global_indices(self, step: int) -> np.ndarray:
        """Sample indices of global step ``step``: each sample's source by the blend, its
        window drawn with replacement from ``(seed, step)``, source by source."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative integer")
        src = self.sources(int(step))
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, int(step)]))
        out = np.empty(src.size, dtype=np.int64)
        for i, n in enumerate(self.sizes):
            mine = src == i
            k = int(mine.sum())
            if k:
                out[mine] = self.offsets[i] + rng.integers(0, int(n), size=k, dtype=np.int64)
        return out

    def __repr__(self) -> str:
        return (f"BlendSampler(sizes={self.sizes.tolist()}, shares="
                f"{[round(float(s), 6) for s in self.shares]}, global_batch_size="
                f"{self.global_batch_size}, seed={self.seed}, step={self.step})")


def blend_hash(sources: Sequence[dict[str, Any]]) -> str:
    """What names a blend: the SHA-256 of its sources' content hashes and normalized
    weights, in order. Pure."""
    key = [[s["hash"], float(s["share"])] for s in sources]
    return "sha256:" + hashlib.sha256(json.dumps(key).encode()).hexdigest()


class BlendedDataset:
    """Windows of several token datasets of one block size, blended (module docstring).

    ``len(ds)``: the sources' windows laid end to end; ``batch(indices)`` reads each from
    its source; :meth:`sampler` (and :meth:`eval_sampler`, which the strategies' evaluation
    uses) the :class:`BlendSampler`. Not collective.
    """

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float],
                 identity: dict[str, Any]) -> None:
        if not datasets or len(datasets) != len(weights):
            raise ValueError("a blend needs one weight per source")
        self.datasets = list(datasets)
        self.block_size = int(self.datasets[0].block_size)
        if any(int(d.block_size) != self.block_size for d in self.datasets):
            raise ValueError("the sources of a blend must have one block size")
        self.shares = normalized(weights)
        self.sizes = np.array([len(d) for d in self.datasets], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.split = self.datasets[0].split
        self._identity = identity

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and next-token targets of the samples ``indices``, each
        ``(n, block_size)`` int64, read from their sources."""
        idx = checked_indices(indices, len(self)).reshape(-1)
        src = np.searchsorted(self.offsets, idx, side="right") - 1
        x = np.empty((idx.size, self.block_size), dtype=np.int64)
        y = np.empty_like(x)
        for i, ds in enumerate(self.datasets):  # (np.unique's first call imports modules)
            mine = src == i
            if mine.any():
                x[mine], y[mine] = ds.batch(idx[mine] - self.offsets[i])
        return x, y

    def sampler(self, global_batch_size: int, seed: int = 0) -> BlendSampler:
        """The training sampler (module docstring)."""
        return BlendSampler(self.sizes, self.shares, global_batch_size, seed=seed)

    def eval_sampler(self, global_batch_size: int, seed: int = 0) -> BlendSampler:
        """The evaluation batches: drawn as in training, so each holds the sources in
        proportion."""
        return self.sampler(global_batch_size, seed=seed)

    def split_counts(self) -> np.ndarray | None:
        """The blend's token frequencies: each source's split frequencies weighted by its
        share (None when a source has no counts)."""
        parts = [d.split_counts() for d in self.datasets]
        if any(p is None for p in parts):
            return None
        size = max(p.size for p in parts)
        mix = np.zeros(size, dtype=np.float64)
        for share, p in zip(self.shares, parts, strict=True):
            total = float(p.sum())
            if total > 0:
                mix[:p.size] += share * p / total
        return mix

    def unigram_baseline(self) -> float:
        """Entropy (nats) of the blend's token frequencies (NaN when a source has none)."""
        mix = self.split_counts()
        return float("nan") if mix is None else entropy(mix)

    def bytes_per_token(self) -> float:
        """UTF-8 bytes per token of the blend: ``sum(w_i * b_i)`` of the sources' bytes
        per token (NaN when a source records none)."""
        return float(sum(w * d.bytes_per_token() for w, d in
                         zip(self.shares, self.datasets, strict=True)))

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records: ``kind`` "blend", ``hash`` (:func:`blend_hash`), the
        ``sources`` (path, weight, share, kind, hash), the ``tokenizer``."""
        return json.loads(json.dumps(self._identity))

    def __repr__(self) -> str:
        return (f"BlendedDataset(split={self.split!r}, sources={len(self.datasets)}, "
                f"shares={[round(float(s), 4) for s in self.shares]}, windows={len(self)})")


def blend_vocabulary(sources: Sequence[Sequence[Any]]) -> tuple[int | None, str]:
    """The vocabulary size of a blend's token files (None: no source names a tokenizer:
    Megatron's and nanoGPT's formats) and the words that name it in an error. Raises
    ValueError for a source that is text or token files made with different tokenizers.
    Reads the files' headers only; not collective."""
    from mpidist.data.tokenfile import TokenFile
    from mpidist.data.tokens import describe_data

    tokenizer, first = None, ""
    for _, path in sources:
        info = describe_data(path)
        if not info.is_tokens:
            raise ValueError(f"--data-blend {path}: text, not a token file (a blend takes "
                             f"token files; mpidist prepare {path} --out FILE --tokenizer "
                             "bytes|bpe:V|tokenizer.json makes one)")
        if info.kind == "tokens":
            tf = TokenFile(info.path)
            if tokenizer is None:
                tokenizer, first = tf, path
            elif tf.tokenizer_json != tokenizer.tokenizer_json:
                raise ValueError(f"--data-blend: {path} and {first} were made with "
                                 "different tokenizers")
    if tokenizer is None:
        return None, "--data-blend (Megatron's and nanoGPT's formats)"
    return tokenizer.vocab_size, "--data-blend"


def open_blend(sources: Sequence[Sequence[Any]], block_size: int, *, val: Any = None,
               comm: Any = None) -> tuple[BlendedDataset, Any]:
    """The training blend of ``sources`` (``[[weight, path], ...]``, :func:`parse_blend`)
    and its validation set: the blend of the sources' validation splits with the same
    weights, or the token file ``val`` (a :class:`~mpidist.data.tokens.DataInfo`).

    Collective over ``comm`` (Megatron and nanoGPT files are hashed between the ranks the
    first time they are used). Raises the same ValueError on every rank for a source that
    is text, token files of different tokenizers, or a split too small for a window.
    """
    from mpidist.data.tokens import describe_data, open_token_data, open_validation

    weights = [float(w) for w, _ in sources]
    shares = normalized(weights)
    trains, valids, records = [], [], []
    tokenizer: dict[str, Any] | None = None
    blend_vocabulary(sources)  # every source a token file, one tokenizer
    for (weight, path), share in zip(sources, shares, strict=True):
        info = describe_data(path)
        train, valid = open_token_data(info, block_size, comm=comm)
        ident = train.identity()
        if tokenizer is None:
            tokenizer = ident.get("tokenizer")
        records.append({"path": path, "weight": float(weight), "share": float(share),
                        "kind": info.kind, "hash": ident["hash"]})
        trains.append(train)
        valids.append(valid)
    identity: dict[str, Any] = {"kind": "blend", "hash": blend_hash(records),
                                "sources": records, "tokenizer": tokenizer,
                                "validation": "held out from each source"}
    if val is not None:
        validation: Any = open_validation(val, block_size, identity, data="--data-blend",
                                          comm=comm)
    else:
        validation = BlendedDataset(valids, weights, identity)
    return BlendedDataset(trains, weights, identity), validation
