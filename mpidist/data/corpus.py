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
takes every byte as it is.

Tokens are bytes (vocabulary 256). The last :data:`VALIDATION_FRACTION` of the text is the
validation split. A sample is a window of ``block_size + 1`` bytes starting at a multiple of
``block_size`` inside its split: ``x`` is the first ``block_size`` bytes, ``y`` the same shifted
by one.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import sysconfig
from collections.abc import Sequence

import numpy as np

from mpidist.data.sampler import checked_indices, checked_int

__all__ = ["MAX_BYTES", "MAX_CONTROL_FRACTION", "STDLIB_FILES", "VALIDATION_FRACTION",
           "TextCorpus", "check_text_path", "corpus_bytes", "path_bytes", "text_problem"]

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

#: Fraction of the text (at its end) held out for validation.
VALIDATION_FRACTION = 0.1

VOCAB_SIZE = 256

#: Largest fraction of control bytes a text may hold (tab, newline, vertical tab, form feed
#: and carriage return are not counted; ESC and the other C0 bytes and DEL are).
MAX_CONTROL_FRACTION = 0.05

_CONTROL = np.zeros(256, dtype=bool)
_CONTROL[np.r_[0:9, 14:32, 127]] = True  # C0 and DEL, but tab, LF, VT, FF and CR
_BINARY_HINT = "--data-binary (binary=True) trains on its bytes anyway"


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


def text_problem(data: bytes) -> str | None:
    """Why ``data`` is not text, or None when it is: not valid UTF-8 (the offset of the first
    bad byte), or more than :data:`MAX_CONTROL_FRACTION` control bytes. Pure."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not valid UTF-8 at byte {exc.start}"
    if not data:
        return None
    control = float(_CONTROL[np.frombuffer(data, dtype=np.uint8)].mean())
    if control > MAX_CONTROL_FRACTION:
        return f"{control:.0%} control bytes"
    return None


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def path_bytes(path: str, *, binary: bool = False
               ) -> tuple[bytes, tuple[str, ...], tuple[str, ...]]:
    """The bytes of a text file, or of every text file under a directory (sorted relative
    paths, joined by newlines, hidden files and directories skipped); the files used; the
    files skipped as not text (:func:`text_problem`). Not collective.

    Raises ValueError naming ``path`` when it does not exist, when it is a file that is not
    text, or when a directory holds no text file; with ``binary=True`` every file is used
    as it is. Read once per process (as :func:`corpus_bytes`): the settings' check and both
    splits of :class:`TextCorpus` share the reading.
    """
    return _path_bytes(path, bool(binary))


@functools.lru_cache(maxsize=4)
def _path_bytes(path: str, binary: bool) -> tuple[bytes, tuple[str, ...], tuple[str, ...]]:
    # One cache key for path_bytes(p) and path_bytes(p, binary=False).
    if os.path.isfile(path):
        data = _read(path)
        problem = None if binary else text_problem(data)
        if problem is not None:
            raise ValueError(f"data={path!r} is not text ({problem}); {_BINARY_HINT}")
        return data, (os.path.basename(path),), ()
    if not os.path.isdir(path):
        raise ValueError(f"data={path!r}: no such file or directory")
    rels = []
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rels += [os.path.relpath(os.path.join(root, n), path) for n in names
                 if not n.startswith(".")]
    parts, used, skipped = [], [], []
    for rel in sorted(rels):
        data = _read(os.path.join(path, rel))
        if not binary and text_problem(data) is not None:
            skipped.append(rel)
            continue
        parts.append(data)
        used.append(rel)
    if not rels:
        raise ValueError(f"data={path!r}: the directory holds no files")
    if not parts:
        raise ValueError(f"data={path!r}: none of its {len(skipped)} file(s) is text (e.g. "
                         f"{skipped[0]}); {_BINARY_HINT}")
    return b"\n".join(parts), tuple(used), tuple(skipped)


def check_text_path(path: str) -> None:
    """Raise the ValueError of :func:`path_bytes` if ``path`` is no text corpus. Not
    collective; reads the files (every rank finds the same)."""
    path_bytes(path)


class TextCorpus:
    """Byte-level language-modelling samples from the standard-library corpus.

    Args:
        block_size: tokens per sample (``x`` and ``y`` both have this length).
        split: ``"train"`` or ``"validation"`` (``"val"`` is accepted).
        max_bytes: cap on the whole corpus (both splits).
        path: a text file, or a directory of files, to use instead of the standard-library
            corpus (read whole, byte-level, split the same way). It must be text (files of a
            directory that are not are skipped, listed in :attr:`skipped`).
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
        if path is None:
            text, self.files = corpus_bytes(STDLIB_FILES, int(max_bytes))
        else:
            text, self.files, self.skipped = path_bytes(path, binary=binary)
            if self.skipped and split == "train":
                log.info("data %s: %d text file(s) used, %d skipped as not text (e.g. %s)",
                         path, len(self.files), len(self.skipped), self.skipped[0])
        self.text = text
        self.fingerprint = hashlib.sha256(text).hexdigest()
        data = np.frombuffer(text, dtype=np.uint8)
        self._cut = cut = int(math.floor(len(data) * (1.0 - VALIDATION_FRACTION)))
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
        counts = np.bincount(self._all[:self._cut], minlength=VOCAB_SIZE).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

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
