"""Data: world-size-invariant samplers, text corpora of any size, token files (``prepare``
writes them; Megatron's and nanoGPT's are read as they are), blends of token files,
synthetic sets."""

from __future__ import annotations

from .blend import BlendedDataset, BlendSampler, open_blend, parse_blend
from .corpus import STDLIB_FILES, TextCorpus, corpus_bytes
from .prepare import prepare
from .sampler import (
    GlobalBatchSampler,
    WindowSampler,
    check_local_sizes,
    micro_batches,
    split_points,
)
from .synthetic import ArrayDataset, synthetic_classification, synthetic_regression
from .tokenfile import TokenFile, verify_token_file
from .tokenizer import Tokenizer
from .tokens import TokenDataset, describe_data, open_token_data

__all__ = [
    "STDLIB_FILES",
    "ArrayDataset",
    "BlendSampler",
    "BlendedDataset",
    "GlobalBatchSampler",
    "TextCorpus",
    "TokenDataset",
    "TokenFile",
    "Tokenizer",
    "WindowSampler",
    "check_local_sizes",
    "corpus_bytes",
    "describe_data",
    "micro_batches",
    "open_blend",
    "open_token_data",
    "parse_blend",
    "prepare",
    "split_points",
    "synthetic_classification",
    "synthetic_regression",
    "verify_token_file",
]
