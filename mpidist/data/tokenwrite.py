"""Writing a token file (:mod:`mpidist.data.tokenfile` describes it) from the ranks' parts.

Rank 0 lays the file out alone (every dataset contiguous, its space allocated at creation
and never filled; attributes; the small datasets), so the HDF5 structure is the same
whatever the number of ranks; every rank then writes its tokens, document offsets and
document lengths at their byte offsets (``pwrite``: the HDF5 library never sees these
writes), the ranks hash the blocks of the token stream between them, and rank 0 writes the
block digests and the content hash. The file is byte-identical at any number of ranks.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpidist.data.tokenfile import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HASH_BLOCK_BYTES,
    block_digests,
    content_hash,
)

__all__ = ["Layout", "Part", "create_layout", "set_content_hash", "write_part"]

_COPY_BYTES = 4 << 20
_PLACEHOLDER = "sha256:" + "0" * 64


@dataclass
class Part:
    """One rank's share of the token stream: its tokens in a spill file, the token and
    byte length of each of its documents, and its token counts."""

    spill: str
    n_tokens: int = 0
    doc_tokens: list[int] = field(default_factory=list)
    doc_bytes: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Layout:
    """Byte offsets of the datasets the ranks write (-1: empty)."""

    tokens: int
    document_offsets: int
    document_bytes: int
    hash_blocks: int

    def as_dict(self) -> dict[str, int]:
        return {"tokens": self.tokens, "document_offsets": self.document_offsets,
                "document_bytes": self.document_bytes, "hash_blocks": self.hash_blocks}


def _big_dataset(f: Any, name: str, shape: tuple[int, ...], dtype: np.dtype) -> int:
    """A contiguous dataset allocated now and never filled; its data's byte offset."""
    import h5py

    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dcpl.set_obj_track_times(False)
    tid = h5py.h5t.py_create(np.dtype(dtype), logical=True)
    space = h5py.h5s.create_simple(shape)
    dsid = h5py.h5d.create(f.id, name.encode(), tid, space, dcpl=dcpl)
    offset = dsid.get_offset()
    dsid.close()
    return -1 if offset is None else int(offset)


def create_layout(path: str, attrs: dict[str, Any], *, dtype: np.dtype, n_tokens: int,
                  n_documents: int, tokenizer_json: str, token_counts: np.ndarray,
                  sources: list[dict[str, Any]], skipped: list[str]) -> Layout:
    """Create the file (rank 0 alone): attributes, every dataset, the small ones written.
    Returns the offsets of those the ranks write."""
    import h5py

    n_blocks = -(-n_tokens * np.dtype(dtype).itemsize // HASH_BLOCK_BYTES)
    text = h5py.string_dtype("utf-8")
    with h5py.File(path, "w") as f:
        root = dict(attrs, format=FORMAT_NAME, format_version=np.int64(FORMAT_VERSION),
                    token_dtype=np.dtype(dtype).name,
                    hash_block_bytes=np.int64(HASH_BLOCK_BYTES), content_hash=_PLACEHOLDER)
        for key in sorted(root):
            f.attrs[key] = root[key]
        layout = Layout(
            tokens=_big_dataset(f, "tokens", (n_tokens,), np.dtype(dtype).newbyteorder("<")),
            document_offsets=_big_dataset(f, "document_offsets", (n_documents + 1,),
                                          np.dtype("<i8")),
            document_bytes=_big_dataset(f, "document_bytes", (n_documents,), np.dtype("<i8")),
            hash_blocks=_big_dataset(f, "hash_blocks", (n_blocks, 32), np.dtype("u1")))
        f.create_dataset("token_counts", data=np.asarray(token_counts, dtype="<i8"),
                         track_times=False)
        f.create_dataset("tokenizer", data=tokenizer_json, dtype=text, track_times=False)
        group = f.create_group("sources")
        columns = {
            "path": (np.array([s["name"] for s in sources], dtype=object), text),
            "bytes": (np.array([s["size"] for s in sources], dtype="<i8"), "<i8"),
            "sha256": (np.array([s["sha256"].encode() for s in sources], dtype="S64"),
                       h5py.string_dtype("ascii", 64)),
            "documents": (np.array([s["documents"] for s in sources], dtype="<i8"), "<i8")}
        for name, (values, dt) in columns.items():
            group.create_dataset(name, data=values, dtype=dt, track_times=False)
        f.create_dataset("skipped", shape=(len(skipped),), dtype=text, track_times=False,
                         data=np.array(skipped, dtype=object) if skipped else None)
    return layout


def _pwrite(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_part(path: str, layout: Layout, part: Part, *, dtype: np.dtype, first_token: int,
               first_document: int, n_tokens: int, n_documents: int, last: bool) -> None:
    """Write this rank's tokens (copied from its spill file), document offsets and
    document lengths into ``path`` at their places; ``last``: also the final offset
    (``n_tokens``, entry ``n_documents``). Not collective."""
    itemsize = np.dtype(dtype).itemsize
    fd = os.open(path, os.O_WRONLY)
    try:
        at = layout.tokens + first_token * itemsize
        with open(part.spill, "rb") as spill:
            while chunk := spill.read(_COPY_BYTES):
                _pwrite(fd, chunk, at)
                at += len(chunk)
        if part.doc_tokens:
            lengths = np.asarray(part.doc_tokens, dtype=np.int64)
            starts = first_token + np.concatenate([[0], np.cumsum(lengths)[:-1]])
            _pwrite(fd, starts.astype("<i8").tobytes(),
                    layout.document_offsets + 8 * first_document)
            _pwrite(fd, np.asarray(part.doc_bytes, dtype="<i8").tobytes(),
                    layout.document_bytes + 8 * first_document)
        if last:
            _pwrite(fd, np.array([n_tokens], dtype="<i8").tobytes(),
                    layout.document_offsets + 8 * n_documents)
        os.fsync(fd)
    finally:
        os.close(fd)


def hash_blocks(path: str, layout: Layout, n_tokens: int, dtype: np.dtype, blocks: range
                ) -> np.ndarray:
    """The SHA-256 digests of token-stream blocks ``blocks`` of the written file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return block_digests(fd, layout.tokens, n_tokens * np.dtype(dtype).itemsize, blocks)
    finally:
        os.close(fd)


def set_content_hash(path: str, layout: Layout, digests: np.ndarray, *, dtype: np.dtype,
                     n_tokens: int, n_documents: int) -> str:
    """Rank 0, once every part is written: the block digests and the content hash. Returns
    the hash."""
    import h5py

    fd = os.open(path, os.O_RDWR)
    try:
        if digests.size:
            _pwrite(fd, np.ascontiguousarray(digests, dtype=np.uint8).tobytes(),
                    layout.hash_blocks)
        h = hashlib.sha256()
        nbytes, pos = 8 * (n_documents + 1), 0
        while pos < nbytes:
            chunk = os.pread(fd, min(_COPY_BYTES, nbytes - pos), layout.document_offsets + pos)
            if not chunk:
                raise OSError(f"{path}: short read of document_offsets")
            h.update(chunk)
            pos += len(chunk)
        os.fsync(fd)
    finally:
        os.close(fd)
    value = content_hash(dtype, n_tokens, HASH_BLOCK_BYTES, digests, h.digest())
    with h5py.File(path, "r+") as f:
        f.attrs.modify("content_hash", value)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return value
