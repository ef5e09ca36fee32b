"""Data: a world-size-invariant batch sampler, an embedded text corpus, synthetic sets."""

from __future__ import annotations

from .corpus import STDLIB_FILES, TextCorpus, corpus_bytes
from .sampler import GlobalBatchSampler, micro_batches
from .synthetic import ArrayDataset, synthetic_classification, synthetic_regression

__all__ = [
    "STDLIB_FILES",
    "ArrayDataset",
    "GlobalBatchSampler",
    "TextCorpus",
    "corpus_bytes",
    "micro_batches",
    "synthetic_classification",
    "synthetic_regression",
]
