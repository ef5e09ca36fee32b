"""A byte-level text corpus built from the Python standard library's own sources.

Every Python installation ships these files, so the corpus needs no download and every rank
of a job (one installation) builds the same bytes. A fixed list of well-known modules is read
in sorted order (those that exist in this Python version), joined by newlines and capped at
:data:`MAX_BYTES`. Different Python versions ship different sources, hence different corpora:
:attr:`TextCorpus.fingerprint` (SHA-256 of the text) tells them apart, and checkpoints can
record it.

A corpus given as a path (``--data``) must be text: valid UTF-8 (any language) with at most
:data:`MAX_CONTROL_FRACTION` control bytes. A file that is not is refused; in a directory,
such files (``__pycache__/*.pyc``, images, archives) are skipped and counted. ``binary=True``
takes every byte as it is. Such a corpus is never read into memory: it is checked, hashed
and counted once, in chunks, and memory-mapped (:mod:`mpidist.data.textfiles`).

Tokens are bytes (vocabulary 256). The last :data:`VALIDATION_FRACTION` of the text is the
validation split. A sample is a window of ``block_size + 1`` bytes starting at a multiple of
``block_size`` inside its split: ``x`` is the first ``block_size`` bytes, ``y`` the same shifted
by one.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sysconfig
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpidist.data.sampler import GlobalBatchSampler, checked_indices, checked_int
from mpidist.data.textfiles import (
    MAX_CONTROL_FRACTION,
    VALIDATION_FRACTION,
    check_text_path,
    entropy,
    map_text,
    split_cut,
    text_problem,
)

__all__ = ["MAX_BYTES", "MAX_CONTROL_FRACTION", "STDLIB_FILES", "VALIDATION_FRACTION",
           "TextCorpus", "check_text_path", "corpus_bytes", "stdlib_paths", "text_problem"]

log = logging.getLogger(__name__)

#: Standard-library sources that make up the corpus (relative to the stdlib directory).
STDLIB_FILES: tuple[str, ...] = (  # sorted
    "abc.py", "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py",
    "cmd.py", "code.py", "codecs.py", "collections/__init__.py", "colorsys.py",
    "configparser.py", "contextlib.py", "copy.py", "csv.py", "dataclasses.py",
    "difflib.py", "dis.py", "enum.py", "fnmatch.py", "fractions.py", "functools.py",
    "getopt.py", "gettext.py", "glob.py", "heapq.py", "hmac.py", "inspect.py",
    "ipaddress.py", "json/__init__.py", "json/decoder.py", "json/encoder.py",
    "keyword.py", "linecache.py", "locale.py", "logging/__init__.py", "numbers.py",
    "operator.py", "optparse.py", "pathlib.py", "pprint.py", "queue.py", "random.py",
    "reprlib.py", "sched.py", "secrets.py", "shlex.py", "shutil.py", "statistics.py",
    "string.py", "textwrap.py", "threading.py", "timeit.py", "token.py",
    "tokenize.py", "traceback.py", "types.py", "typing.py", "uuid.py", "warnings.py",
    "weakref.py", "zipfile.py",
)

#: Cap on the corpus size in bytes.
MAX_BYTES = 4 * 1024 * 1024

VOCAB_SIZE = 256


def stdlib_paths(files: tuple[str, ...] = STDLIB_FILES) -> list[str]:
    """The paths of the corpus's files that exist in this Python installation, sorted (what
    ``mpidist prepare --stdlib`` tokenizes, each file a document). Not collective."""
    root = sysconfig.get_paths()["stdlib"]
    paths = [os.path.join(root, *rel.split("/")) for rel in sorted(files)]
    return [p for p in paths if os.path.isfile(p)]


@functools.lru_cache(maxsize=4)
def corpus_bytes(
    files: tuple[str, ...] = STDLIB_FILES, max_bytes: int = MAX_BYTES
) -> tuple[bytes, tuple[str, ...]]:
    """The corpus text and the files it was made of (those of ``files`` that exist here)."""
    root = sysconfig.get_paths()["stdlib"]
    parts: list[bytes] = []
    used: list[str] = []
    for rel in sorted(files):
        path = os.path.join(root, *rel.split("/"))
        if os.path.isfile(path):
            with open(path, "rb") as fh:
                parts.append(fh.read())
            used.append(rel)
    if not parts:
        raise FileNotFoundError(
            "none of the standard-library corpus files exist under the stdlib directory "
            f"{root!r}; this Python installation ships no .py sources"
        )
    text = b"\n".join(parts)[:max_bytes]
    return text, tuple(used)


class TextCorpus:
    """Byte-level language-modelling samples from the standard-library corpus.

    Args:
        block_size: tokens per sample (``x`` and ``y`` both have this length).
        split: ``"train"`` or ``"validation"`` (``"val"`` is accepted).
        max_bytes: cap on the whole corpus (both splits).
        path: a text file, or a directory of files, to use instead of the standard-library
            corpus (memory-mapped, byte-level, split the same way). It must be text (files of
            a directory that are not are skipped, listed in :attr:`skipped`).
        binary: use the bytes of ``path`` whatever they are.

    ``len(corpus)`` samples; ``corpus[i] -> (x, y)`` 1-D int64 arrays;
    ``corpus.batch(indices) -> (x, y)`` of shape ``(len(indices), block_size)``.
    """

    vocab_size = VOCAB_SIZE

    def __init__(
        self, block_size: int, split: str = "train", *, max_bytes: int = MAX_BYTES,
        path: str | None = None, binary: bool = False,
    ) -> None:
        block_size = checked_int(block_size, "block_size", 1)
        if split == "val":
            split = "validation"
        if split not in ("train", "validation"):
            raise ValueError(f"split={split!r} must be 'train' or 'validation'")
        self.block_size = block_size
        self.split = split
        self.skipped: tuple[str, ...] = ()
        self.path = path
        if path is None:
            text, self.files = corpus_bytes(STDLIB_FILES, int(max_bytes))
            self.fingerprint = hashlib.sha256(text).hexdigest()
            data = np.frombuffer(text, dtype=np.uint8)
            self._train_counts = np.bincount(data[:split_cut(len(data))], minlength=VOCAB_SIZE)
        else:
            scan, data = map_text(path, bool(binary))
            self.files, self.skipped = scan.files, scan.skipped
            self.fingerprint = scan.sha256
            self._train_counts = np.asarray(scan.train_counts, dtype=np.int64)
            text = data
            if self.skipped and split == "train":
                log.info("data %s: %d text file(s) used, %d skipped as not text (e.g. %s)",
                         path, len(self.files), len(self.skipped), self.skipped[0])
        #: the corpus: bytes (the embedded one) or a read-only uint8 memory map (a path)
        self.text = text
        self._cut = cut = split_cut(len(data))
        self.split_start, self.split_stop = (0, cut) if split == "train" else (cut, len(data))
        self._all = data
        self.tokens = data[self.split_start : self.split_stop]
        n = (len(self.tokens) - 1) // self.block_size
        if n < 1:
            raise ValueError(
                f"block_size={block_size} leaves no sample in the {split} split of "
                f"{len(self.tokens)} bytes"
            )
        self._n = n

    def __len__(self) -> int:
        return self._n

    @property
    def offsets(self) -> np.ndarray:
        """Start of every sample window, as positions in the whole corpus text."""
        return self.split_start + np.arange(self._n, dtype=np.int64) * self.block_size

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and next-byte targets of samples ``indices``, each ``(n, block_size)``."""
        idx = checked_indices(indices, self._n).reshape(-1)
        starts = idx * self.block_size
        win = starts[:, None] + np.arange(self.block_size + 1)[None, :]
        chunk = self.tokens[win].astype(np.int64)
        return chunk[:, :-1], chunk[:, 1:]

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.batch(np.array([i]))
        return x[0], y[0]

    def unigram_baseline(self) -> float:
        """Entropy (nats) of the byte frequencies of the *train* split.

        The cross-entropy of the best context-free model: a language model that has learned
        anything beats it on validation data.
        """
        return entropy(self._train_counts)

    def bytes_per_token(self) -> float:
        """Bytes of text per token: 1 (the tokens are the bytes)."""
        return 1.0

    def sampler(self, global_batch_size: int, seed: int = 0) -> GlobalBatchSampler:
        """The training sampler of this corpus: every sample once per epoch, in an order
        drawn from ``(seed, epoch)``."""
        return GlobalBatchSampler(self._n, global_batch_size, seed=seed)

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records about the data: its kind, hash and tokenizer (bytes)."""
        return {"kind": "text", "hash": f"sha256:{self.fingerprint}",
                "tokenizer": {"name": "text-bytes", "vocab_size": VOCAB_SIZE, "eod_id": None}}

    @staticmethod
    def encode(text: str) -> np.ndarray:
        """UTF-8 bytes of ``text`` as token ids."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    @staticmethod
    def decode(ids: Sequence[int] | np.ndarray) -> str:
        """Token ids back to text (invalid UTF-8 sequences are replaced)."""
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
            raise ValueError(f"token ids must be in [0, {VOCAB_SIZE})")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return (
            f"TextCorpus(block_size={self.block_size}, split={self.split!r}, samples={self._n}, "
            f"bytes={len(self.tokens)}, fingerprint={self.fingerprint[:12]})"
        )
