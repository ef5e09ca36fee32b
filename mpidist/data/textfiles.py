"""Plain-text corpora of any size in constant memory: checked, hashed and counted in chunks.

A text file is read once, in chunks of :data:`CHUNK_BYTES`: its UTF-8 is checked (the
offset of the first bad byte), its control bytes counted, its SHA-256 computed and its byte
frequencies of the train split (the first ``floor(n * (1 - VALIDATION_FRACTION))`` bytes)
counted for the unigram baseline. The result is kept in the user's data cache
(:mod:`mpidist.data.cache`) under the file's identity (path, size, modification time,
inode), so later runs on the same file read nothing before training.

A directory is turned, once, into one cache file: its text files (sorted relative paths,
hidden files and directories skipped, files that are not text skipped and counted) joined by
newlines, exactly the bytes the corpus is made of; the training reads that file through a
memory map. Nothing reads a whole corpus into memory.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import hashlib
import math
import os
import tempfile
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from mpidist.data.cache import cache_key, cached_json, file_identity

__all__ = ["CHUNK_BYTES", "MAX_CONTROL_FRACTION", "VALIDATION_FRACTION", "TextChecker",
           "TextScan", "check_text_path", "count_ids", "entropy", "map_text", "read_chunks",
           "scan_text", "split_cut", "text_problem"]

#: Bytes read at a time.
CHUNK_BYTES = 4 << 20
_SLICE = 1 << 16  # bytes decoded, or ids counted, at a time

#: Fraction of the text (at its end) held out for validation.
VALIDATION_FRACTION = 0.1

#: Largest fraction of control bytes a text may hold (tab, newline, vertical tab, form feed
#: and carriage return are not counted; ESC and the other C0 bytes and DEL are).
MAX_CONTROL_FRACTION = 0.05

_CONTROL = np.zeros(256, dtype=bool)
_CONTROL[np.r_[0:9, 14:32, 127]] = True  # C0 and DEL, but tab, LF, VT, FF and CR
BINARY_HINT = "--data-binary (binary=True) trains on its bytes anyway"


def text_problem(data: bytes) -> str | None:
    """Why ``data`` is not text, or None when it is: not valid UTF-8 (the offset of the first
    bad byte), or more than :data:`MAX_CONTROL_FRACTION` control bytes. Pure."""
    checker = TextChecker()
    checker.feed(data)
    return checker.finish()


def entropy(counts: np.ndarray) -> float:
    """Entropy (nats) of the frequencies ``counts``."""
    counts = np.asarray(counts, dtype=np.float64)
    p = counts[counts > 0] / max(counts.sum(), 1.0)
    return float(-(p * np.log(p)).sum())


class TextChecker:
    """Incremental :func:`text_problem`: ``feed`` chunks (UTF-8 is checked across their
    boundaries, control bytes counted), then ``finish()`` gives the problem or None."""

    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.seen = 0
        self.counts = np.zeros(256, dtype=np.int64)
        self.problem: str | None = None

    def feed(self, chunk: bytes | memoryview, counts: np.ndarray | None = None) -> None:
        """Check ``chunk`` (``counts``: its byte counts, when the caller has them)."""
        if self.problem is not None:
            return
        view = memoryview(chunk)
        for a in range(0, len(view), _SLICE):  # small strings: no large transient memory
            pending = len(self.decoder.getstate()[0])
            try:
                self.decoder.decode(view[a:a + _SLICE], final=False)
            except UnicodeDecodeError as exc:
                self.problem = f"not valid UTF-8 at byte {self.seen + a - pending + exc.start}"
                break
        self.seen += len(view)
        self.counts += _bincount(view) if counts is None else counts

    def finish(self) -> str | None:
        if self.problem is None:
            pending = len(self.decoder.getstate()[0])
            try:
                self.decoder.decode(b"", final=True)
            except UnicodeDecodeError as exc:
                self.problem = f"not valid UTF-8 at byte {self.seen - pending + exc.start}"
        if self.problem is None and self.seen:
            control = float(self.counts[_CONTROL].sum()) / self.seen
            if control > MAX_CONTROL_FRACTION:
                self.problem = f"{control:.0%} control bytes"
        return self.problem


def count_ids(ids: np.ndarray, size: int = 0) -> np.ndarray:
    """Occurrences of each value of the non-negative integer array ``ids`` (int64, at least
    ``size`` entries), counted in slices of 64 Ki elements: ``np.bincount`` copies its
    input as 8-byte integers, and small copies keep the anonymous memory flat."""
    out = np.zeros(size, dtype=np.int64)
    step = _SLICE
    for a in range(0, len(ids), step):
        c = np.bincount(np.asarray(ids[a:a + step]), minlength=size)
        if c.size > out.size:
            c[:out.size] += out
            out = c.astype(np.int64, copy=False)
        else:
            out[:c.size] += c
    return out


def _bincount(chunk: bytes | memoryview) -> np.ndarray:
    return count_ids(np.frombuffer(chunk, dtype=np.uint8), 256)


def read_chunks(f: BinaryIO) -> Any:
    """The bytes of the open file ``f`` in chunks of up to :data:`CHUNK_BYTES`, read into
    one reused buffer (each chunk is a view that the next one overwrites): reading costs
    no memory beyond the buffer (no larger than the file)."""
    try:
        size = os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError):  # a compressed stream: its size is unknown
        size = CHUNK_BYTES
    buf = bytearray(max(1, min(CHUNK_BYTES, size)))
    view = memoryview(buf)
    while True:
        n = f.readinto(buf)
        if not n:
            return
        yield view[:n]


@dataclass(frozen=True)
class TextScan:
    """What one pass over a corpus found (see the module docstring)."""

    source: str  #: the file whose bytes are the corpus (a directory's cache file)
    size: int  #: bytes of the corpus
    sha256: str  #: SHA-256 of the corpus bytes
    train_counts: tuple[int, ...]  #: byte frequencies of the train split (256)
    files: tuple[str, ...]  #: files used (a directory's relative paths)
    skipped: tuple[str, ...]  #: files skipped as not text
    temporary: bool = False  #: ``source`` is a private file to remove once mapped

    @property
    def cut(self) -> int:
        """First byte of the validation split."""
        return split_cut(self.size)


def split_cut(size: int) -> int:
    """First byte of the validation split of ``size`` bytes."""
    return int(math.floor(size * (1.0 - VALIDATION_FRACTION)))


def _scan_file(path: str, binary: bool) -> dict[str, Any]:
    """One pass over a file: problem (or None), SHA-256, train-split byte counts."""
    size = os.path.getsize(path)
    cut = split_cut(size)
    checker = TextChecker()
    digest = hashlib.sha256()
    train = np.zeros(256, dtype=np.int64)
    pos = 0
    with open(path, "rb") as f:
        for chunk in read_chunks(f):
            counts = _bincount(chunk)
            if pos + len(chunk) <= cut:
                train += counts
            elif pos < cut:
                train += _bincount(memoryview(chunk)[:cut - pos])
            if not binary:
                checker.feed(chunk, counts)
                if checker.problem is not None:
                    break
            digest.update(chunk)
            pos += len(chunk)
    problem = None if binary else checker.finish()
    return {"problem": problem, "sha256": digest.hexdigest(), "size": size,
            "train_counts": train.tolist()}


def _listing(path: str) -> list[str]:
    rels = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rels += [os.path.relpath(os.path.join(root, n), path) for n in names
                 if not n.startswith(".")]
    return sorted(rels)


def _build_directory(path: str, rels: list[str], binary: bool, data_path: str
                     ) -> dict[str, Any]:
    """Join the text files of ``path`` into ``data_path``; the entry describing it."""
    digest = hashlib.sha256()
    counts = np.zeros(256, dtype=np.int64)
    used: list[str] = []
    skipped: list[str] = []
    tmp = data_path + f".tmp-{os.getpid()}"
    with open(tmp, "wb") as out:
        for rel in rels:
            mark, saved, saved_counts = out.tell(), digest.copy(), counts.copy()
            checker = TextChecker()
            if used:
                out.write(b"\n")
                digest.update(b"\n")
                counts[10] += 1
            with open(os.path.join(path, rel), "rb") as f:
                for chunk in read_chunks(f):
                    c = _bincount(chunk)
                    if not binary:
                        checker.feed(chunk, c)
                        if checker.problem is not None:
                            break
                    out.write(chunk)
                    digest.update(chunk)
                    counts += c
            if not binary and checker.finish() is not None:
                out.seek(mark)
                out.truncate()
                digest, counts = saved, saved_counts
                skipped.append(rel)
                continue
            used.append(rel)
        size = out.tell()
    cut = split_cut(size)
    with open(tmp, "rb") as f:  # the validation tail is not part of the baseline
        f.seek(cut)
        for chunk in read_chunks(f):
            counts -= _bincount(chunk)
    os.replace(tmp, data_path)
    return {"size": size, "sha256": digest.hexdigest(), "train_counts": counts.tolist(),
            "files": used, "skipped": skipped}


def scan_text(path: str, *, binary: bool = False) -> TextScan:
    """The corpus of ``path``: a text file, or every text file under a directory.

    Not collective; the result is cached (module docstring), so every process and every
    later run agree without reading again. Raises ValueError naming ``path`` when it does not
    exist, when it is a file that is not text, when a directory holds no file or no text
    file; ``binary=True`` takes every file as it is.
    """
    binary = bool(binary)
    if os.path.isfile(path):
        entry = cached_json(cache_key("text", file_identity(path), binary),
                            lambda _prefix: _scan_file(path, binary))
        if entry["problem"] is not None:
            raise ValueError(f"data={path!r} is not text ({entry['problem']}); {BINARY_HINT}")
        return TextScan(path, entry["size"], entry["sha256"], tuple(entry["train_counts"]),
                        (os.path.basename(path),), ())
    if not os.path.isdir(path):
        raise ValueError(f"data={path!r}: no such file or directory")
    rels = _listing(path)
    if not rels:
        raise ValueError(f"data={path!r}: the directory holds no files")
    ids = [[rel, *file_identity(os.path.join(path, rel))[1:]] for rel in rels]
    key = cache_key("textdir", os.path.realpath(path), ids, binary)

    def build(prefix: str | None) -> dict[str, Any]:
        temporary = prefix is None  # no usable cache: a private file, removed once mapped
        if temporary:
            fd, data_path = tempfile.mkstemp(prefix="mpidist-text-")
            os.close(fd)
        else:
            data_path = prefix + ".bytes"
        entry = _build_directory(path, rels, binary, data_path)
        return {**entry, "data": data_path, "temporary": temporary}

    entry = cached_json(key, build)
    if not entry["files"]:
        if entry.get("temporary"):
            with contextlib.suppress(OSError):
                os.remove(entry["data"])
        raise ValueError(f"data={path!r}: none of its {len(entry['skipped'])} file(s) is text "
                         f"(e.g. {entry['skipped'][0]}); {BINARY_HINT}")
    if not os.path.isfile(entry["data"]) or os.path.getsize(entry["data"]) != entry["size"]:
        raise ValueError(f"data={path!r}: its cache file {entry['data']!r} is missing or "
                         "changed; delete it and its .json entry and run again")
    return TextScan(entry["data"], entry["size"], entry["sha256"],
                    tuple(entry["train_counts"]), tuple(entry["files"]),
                    tuple(entry["skipped"]), bool(entry.get("temporary")))


@functools.lru_cache(maxsize=8)
def map_text(path: str, binary: bool = False) -> tuple[TextScan, np.ndarray]:
    """:func:`scan_text` and the corpus bytes as a read-only uint8 memory map (pages are the
    page cache's: mapping costs no anonymous memory). Once per process. Not collective."""
    scan = scan_text(path, binary=binary)
    if scan.size == 0:
        return scan, np.zeros(0, dtype=np.uint8)
    data = np.memmap(scan.source, dtype=np.uint8, mode="r", shape=(scan.size,))
    if scan.temporary:
        with contextlib.suppress(OSError):
            os.remove(scan.source)  # the mapping keeps the pages
    return scan, data


def check_text_path(path: str) -> None:
    """Raise the ValueError of :func:`scan_text` if ``path`` is no text corpus. Not
    collective; cached, so every rank finds the same at the cost of one reading."""
    scan_text(path)
