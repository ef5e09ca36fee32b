"""Data: a world-size-invariant batch sampler, an embedded text corpus, synthetic sets."""

from __future__ import annotations

from .corpus import STDLIB_FILES, TextCorpus, corpus_bytes
from .sampler import GlobalBatchSampler, check_local_sizes, micro_batches, split_points
from .synthetic import ArrayDataset, synthetic_classification, synthetic_regression

__all__ = [
    "STDLIB_FILES",
    "ArrayDataset",
    "GlobalBatchSampler",
    "TextCorpus",
    "check_local_sizes",
    "corpus_bytes",
    "micro_batches",
    "split_points",
    "synthetic_classification",
    "synthetic_regression",
]
