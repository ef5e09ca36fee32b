"""The HDF5 token file ``mpidist prepare`` writes, and reading it (docs/data.md).

Root attributes: ``format`` ("mpidist-tokens"), ``format_version`` (1), ``n_tokens``,
``n_documents``, ``n_bytes`` (UTF-8 bytes of the documents' text), ``vocab_size``,
``eod_id`` (-1: none), ``tokenizer_name``, ``token_dtype``, ``hash_block_bytes`` and
``content_hash``. Datasets, all contiguous and unfiltered:

* ``tokens`` (n_tokens,) uint16 or uint32: every document's ids back to back, each followed
  by the end-of-document id when the tokenizer has one;
* ``document_offsets`` (n_documents + 1,) int64: where each document starts in ``tokens``,
  then ``n_tokens``;
* ``document_bytes`` (n_documents,) int64: each document's UTF-8 length (optional to a
  reader: without it, bits per byte is not reported);
* ``token_counts`` (vocab_size,) int64: occurrences of each id in ``tokens``;
* ``hash_blocks`` (n_blocks, 32) uint8: SHA-256 of each ``hash_block_bytes`` block of the
  little-endian bytes of ``tokens`` (the last block shorter);
* ``tokenizer``: the tokenizer's ``tokenizers`` JSON (a string);
* ``sources/path``, ``sources/bytes``, ``sources/sha256``, ``sources/documents``: the
  inputs (as given, or relative to a directory given), their sizes, SHA-256 and documents;
  ``skipped``: files of directories that were not text.

``content_hash`` is ``"sha256:" + SHA-256`` of ``b"mpidist-tokens/1\\0"``, the token dtype's
name and a NUL, ``n_tokens`` and ``hash_block_bytes`` (8 bytes little-endian each), every
block digest in order and the SHA-256 of ``document_offsets``' bytes: it names the data a
run trained on. Nothing in the file depends on the number of ranks that wrote it.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Any

import numpy as np

from mpidist.core import collectives as C
from mpidist.core.comms import size_rank
from mpidist.data.sampler import split_points

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "HASH_BLOCK_BYTES", "TokenFile", "block_digests",
           "content_hash", "is_token_file", "verify_token_file"]

FORMAT_NAME = "mpidist-tokens"
FORMAT_VERSION = 1
#: Bytes of the token stream per hash block.
HASH_BLOCK_BYTES = 16 << 20
_READ_BYTES = 4 << 20
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _h5py() -> Any:
    import h5py

    return h5py


def is_token_file(path: str) -> bool:
    """Whether ``path`` is an HDF5 file (its signature at byte 0; mpidist writes no user
    block). Not collective."""
    try:
        with open(path, "rb") as f:
            return f.read(8) == _HDF5_SIGNATURE
    except OSError:
        return False


def content_hash(dtype: np.dtype, n_tokens: int, block_bytes: int, digests: np.ndarray,
                 offsets_sha256: bytes) -> str:
    """The ``content_hash`` attribute (module docstring). Pure."""
    h = hashlib.sha256(f"{FORMAT_NAME}/{FORMAT_VERSION}\0".encode())
    h.update(np.dtype(dtype).name.encode() + b"\0")
    h.update(struct.pack("<QQ", int(n_tokens), int(block_bytes)))
    h.update(np.ascontiguousarray(digests, dtype=np.uint8).tobytes())
    h.update(offsets_sha256)
    return "sha256:" + h.hexdigest()


def _pread_all(fd: int, offset: int, nbytes: int) -> bytes:
    parts, done = [], 0
    while done < nbytes:
        chunk = os.pread(fd, min(_READ_BYTES, nbytes - done), offset + done)
        if not chunk:
            raise ValueError("unexpected end of file")
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)


def block_digests(fd: int, offset: int, nbytes: int, blocks: range,
                  block_bytes: int = HASH_BLOCK_BYTES) -> np.ndarray:
    """SHA-256 of blocks ``blocks`` of the ``nbytes`` bytes at ``offset`` of file ``fd``,
    ``(len(blocks), 32)`` uint8, read in chunks. Not collective."""
    out = np.zeros((len(blocks), 32), dtype=np.uint8)
    for i, b in enumerate(blocks):
        lo = b * block_bytes
        hi = min(nbytes, lo + block_bytes)
        h = hashlib.sha256()
        pos = lo
        while pos < hi:
            n = min(_READ_BYTES, hi - pos)
            chunk = os.pread(fd, n, offset + pos)
            if len(chunk) != n:
                raise ValueError(f"unexpected end of file in token bytes {pos}-{pos + n}")
            h.update(chunk)
            pos += n
        out[i] = np.frombuffer(h.digest(), dtype=np.uint8)
    return out


def _offsets_sha256(fd: int, offset: int, nbytes: int) -> bytes:
    h = hashlib.sha256()
    pos = 0
    while pos < nbytes:
        chunk = _pread_all(fd, offset + pos, min(_READ_BYTES, nbytes - pos))
        h.update(chunk)
        pos += len(chunk)
    return h.digest()


def _contiguous_offset(ds: Any, path: str, name: str) -> int:
    """Byte offset of a contiguous, unfiltered dataset's data; ValueError otherwise."""
    h5py = _h5py()
    if not ds.size:
        return -1
    dcpl = ds.id.get_create_plist()
    offset = ds.id.get_offset()
    if dcpl.get_layout() != h5py.h5d.CONTIGUOUS or dcpl.get_external_count() or offset is None:
        raise ValueError(f"{path}: dataset {name!r} is not stored contiguously (it was not "
                         "written by mpidist prepare)")
    return int(offset)


class TokenFile:
    """A token file opened for reading: checked, its streams memory-mapped.

    Opening reads the attributes and the small datasets and checks the format name and
    version, the datasets' shapes and dtypes against the attributes, and that the file
    holds every byte they need (a truncated file is refused); the content hash is checked
    by :func:`verify_token_file`. ``tokens`` and ``document_offsets`` are read-only memory
    maps (the page cache's pages, no anonymous memory). Not collective; raises ValueError
    naming the file and what is wrong.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        h5py = _h5py()
        try:
            f = h5py.File(path, "r")
        except (OSError, ValueError) as exc:
            if not os.path.exists(path):
                raise ValueError(f"data={path!r}: no such file") from None
            raise ValueError(f"{path}: not a readable HDF5 token file (truncated or "
                             f"corrupted?): {str(exc).splitlines()[0]}") from None
        with f:
            self._read_header(f)

    def _read_header(self, f: Any) -> None:
        path, a = self.path, f.attrs
        fmt = a.get("format")
        fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
        if fmt != FORMAT_NAME:
            raise ValueError(f"{path}: not an mpidist token file (root attribute format="
                             f"{fmt!r}, expected {FORMAT_NAME!r})")
        version = a.get("format_version")
        version = version.item() if isinstance(version, np.generic) else version
        if version != FORMAT_VERSION:
            raise ValueError(f"{path}: token file format_version={version!r}; this version "
                             f"of mpidist reads version {FORMAT_VERSION}")
        try:
            self.n_tokens = int(a["n_tokens"])
            self.n_documents = int(a["n_documents"])
            self.n_bytes = int(a["n_bytes"])
            self.vocab_size = int(a["vocab_size"])
            eod = int(a["eod_id"])
            self.eod_id = None if eod < 0 else eod
            self.tokenizer_name = str(a["tokenizer_name"])
            self.dtype = np.dtype(str(a["token_dtype"])).newbyteorder("<")
            self.block_bytes = int(a["hash_block_bytes"])
            self.content_hash = str(a["content_hash"])
            tokens, offsets = f["tokens"], f["document_offsets"]
            self.tokenizer_json = f["tokenizer"][()]
            self.token_counts = np.asarray(f["token_counts"][...], dtype=np.int64)
            n_blocks = f["hash_blocks"].shape[0]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: token file lacks or mangles {exc}") from None
        if isinstance(self.tokenizer_json, bytes):
            self.tokenizer_json = self.tokenizer_json.decode("utf-8")
        want = {"tokens": ((self.n_tokens,), self.dtype),
                "document_offsets": ((self.n_documents + 1,), np.dtype("<i8"))}
        for name, (shape, dtype) in want.items():
            ds = f[name]
            if ds.shape != shape or ds.dtype != dtype:
                raise ValueError(f"{path}: dataset {name!r} is {ds.shape} {ds.dtype}, the "
                                 f"attributes say {shape} {dtype}")
        if n_blocks != -(-self.n_tokens * self.dtype.itemsize // self.block_bytes):
            raise ValueError(f"{path}: hash_blocks has {n_blocks} rows for {self.n_tokens} "
                             "tokens")
        self._tokens_at = _contiguous_offset(tokens, path, "tokens")
        self._offsets_at = _contiguous_offset(offsets, path, "document_offsets")
        self._blocks_at = _contiguous_offset(f["hash_blocks"], path, "hash_blocks")
        size = os.path.getsize(path)
        for at, n in ((self._tokens_at, self.n_tokens * self.dtype.itemsize),
                      (self._offsets_at, 8 * (self.n_documents + 1))):
            if at + n > size:
                raise ValueError(f"{path}: truncated: {size} bytes, the token data needs "
                                 f"{at + n}")
        self.tokens = np.memmap(path, dtype=self.dtype, mode="r", offset=self._tokens_at,
                                shape=(self.n_tokens,))
        self.document_offsets = np.memmap(path, dtype="<i8", mode="r",
                                          offset=self._offsets_at,
                                          shape=(self.n_documents + 1,))
        self.document_bytes = self._map_document_bytes(f, size)
        if self.document_offsets[0] != 0 or self.document_offsets[-1] != self.n_tokens:
            raise ValueError(f"{path}: document_offsets run from "
                             f"{int(self.document_offsets[0])} to "
                             f"{int(self.document_offsets[-1])}, not 0 to {self.n_tokens}")

    def _map_document_bytes(self, f: Any, size: int) -> np.ndarray | None:
        """The documents' UTF-8 lengths, memory-mapped (None for a file without them: they
        are optional to a reader, and bits per byte is then not reported)."""
        ds = f.get("document_bytes")
        if ds is None or ds.shape != (self.n_documents,) or ds.dtype != np.dtype("<i8"):
            return None
        if not self.n_documents:
            return np.zeros(0, dtype=np.int64)
        at = _contiguous_offset(ds, self.path, "document_bytes")
        if at + 8 * self.n_documents > size:
            raise ValueError(f"{self.path}: truncated: {size} bytes, the document lengths "
                             f"need {at + 8 * self.n_documents}")
        return np.memmap(self.path, dtype="<i8", mode="r", offset=at,
                         shape=(self.n_documents,))

    def tokenizer_record(self) -> dict[str, Any]:
        """The tokenizer as :meth:`mpidist.data.tokenizer.Tokenizer.record` makes it."""
        return {"name": self.tokenizer_name, "vocab_size": self.vocab_size,
                "eod_id": self.eod_id, "json": self.tokenizer_json}

    def summary(self) -> dict[str, Any]:
        """The attributes, as JSON."""
        return {"path": self.path, "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
                "n_tokens": self.n_tokens, "n_documents": self.n_documents,
                "n_bytes": self.n_bytes, "vocab_size": self.vocab_size,
                "eod_id": self.eod_id, "tokenizer": self.tokenizer_name,
                "token_dtype": self.dtype.name, "content_hash": self.content_hash}


def verify_token_file(path: str, *, comm: Any = None) -> None:
    """Check the content hash of a token file: every block's SHA-256 against
    ``hash_blocks`` and their combination against ``content_hash``. Collective over
    ``comm`` (None: one process): the blocks are split over the ranks, one allreduce of the
    first bad block. Raises the same ValueError on every rank, naming the file and the
    first bad block's token range."""
    size, rank = size_rank(comm)
    tf = TokenFile(path)
    nbytes = tf.n_tokens * tf.dtype.itemsize
    n_blocks = -(-nbytes // tf.block_bytes)
    cuts = split_points(n_blocks, min(size, n_blocks)) if n_blocks else [0]
    mine = range(cuts[rank], cuts[rank + 1]) if rank + 1 < len(cuts) else range(0)
    fd = os.open(path, os.O_RDONLY)
    try:
        stored = np.zeros((n_blocks, 32), dtype=np.uint8)
        if n_blocks:
            stored[...] = np.frombuffer(_pread_all(fd, tf._blocks_at, n_blocks * 32),
                                        dtype=np.uint8).reshape(n_blocks, 32)
        got = block_digests(fd, tf._tokens_at, nbytes, mine, tf.block_bytes)
        bad = [b for i, b in enumerate(mine) if not np.array_equal(got[i], stored[b])]
        first = np.array([bad[0] if bad else n_blocks], dtype=np.int64)
        C.allreduce(first, "min", comm=comm)
        offsets_sha = _offsets_sha256(fd, tf._offsets_at, 8 * (tf.n_documents + 1))
    finally:
        os.close(fd)
    if first[0] < n_blocks:
        per = tf.block_bytes // tf.dtype.itemsize
        b = int(first[0])
        raise ValueError(f"{path}: tokens {b * per}-{min(tf.n_tokens, (b + 1) * per) - 1} "
                         f"(hash block {b}) fail their hash: the file changed after it was "
                         "written")
    expect = content_hash(tf.dtype, tf.n_tokens, tf.block_bytes, stored, offsets_sha)
    if expect != tf.content_hash:
        raise ValueError(f"{path}: content_hash {tf.content_hash} does not match its blocks "
                         f"and document offsets ({expect})")
