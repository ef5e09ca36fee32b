"""Token files of other tools, read as they are: Megatron's indexed dataset and nanoGPT's
``train.bin`` / ``val.bin``.

* Megatron (megatron-core's ``IndexedDatasetBuilder``): ``PREFIX.bin`` holds the tokens of
  every sequence back to back; ``PREFIX.idx`` (little-endian) is ``b"MMIDIDX\\x00\\x00"``, a
  u64 version (1), a u8 dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16),
  u64 sequence count S, u64 document-index count D, int32[S] sequence lengths, int64[S]
  byte offsets of the sequences in ``.bin`` and int64[D] document indices (the sequences
  where documents start, from 0 to S).
* nanoGPT: a raw ``uint16`` array of token ids with no header and no document index.

Neither names its tokenizer, so the vocabulary comes from ``--vocab-size``. The first time
a file is used its content is hashed (SHA-256 over 16 MiB blocks, the blocks split over the
ranks), and its ids counted (the largest id is checked against the vocabulary; the counts
give the unigram baseline); the result is kept in the user's data cache
(:mod:`mpidist.data.cache`), so later runs read nothing before training.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Any

import numpy as np

from mpidist.core import collectives as C
from mpidist.core.comms import bcast_json, size_rank
from mpidist.data.cache import cache_dir, cache_key, file_identity, write_json_atomic
from mpidist.data.sampler import split_points
from mpidist.data.textfiles import count_ids

__all__ = ["MEGATRON_DTYPES", "MegatronFile", "NanoGPTFile", "megatron_prefix", "scan_tokens"]

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
#: Megatron's dtype codes that hold token ids (6 float64 and 7 float32 do not).
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                   8: np.uint16}
_HEADER = struct.Struct("<9sQBQQ")
_BLOCK_BYTES = 16 << 20
_READ_BYTES = 4 << 20


def megatron_prefix(path: str) -> str | None:
    """The prefix of a Megatron dataset named by ``path`` (the prefix itself, or its
    ``.bin`` or ``.idx`` file), or None when ``path`` names none. Not collective."""
    for prefix in (path, path[:-4] if path.endswith((".bin", ".idx")) else None):
        if prefix and os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin"):
            with open(prefix + ".idx", "rb") as f:
                if f.read(len(MEGATRON_MAGIC)) == MEGATRON_MAGIC:
                    return prefix
    return None


class MegatronFile:
    """A Megatron indexed dataset: its tokens as one memory-mapped stream and the token
    offsets where its documents start. Opening reads the header and checks that both files
    hold every byte the index names (ValueError naming the file otherwise). Not
    collective."""

    kind = "megatron"
    max_id: int | None = None  #: the largest id, once :func:`scan_tokens` has run

    def __init__(self, prefix: str) -> None:
        self.path = prefix
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        size = os.path.getsize(idx)
        with open(idx, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise ValueError(f"{idx}: truncated Megatron index ({size} bytes)")
        magic, version, code, n_seq, n_doc = _HEADER.unpack(head)
        if magic != MEGATRON_MAGIC:
            raise ValueError(f"{idx}: not a Megatron index (magic {magic!r})")
        if version != 1:
            raise ValueError(f"{idx}: Megatron index version {version}; version 1 is read")
        if code not in MEGATRON_DTYPES:
            raise ValueError(f"{idx}: dtype code {code} is not a token id type (one of "
                             f"{sorted(MEGATRON_DTYPES)})")
        self.dtype = np.dtype(MEGATRON_DTYPES[code]).newbyteorder("<")
        need = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if size < need:
            raise ValueError(f"{idx}: truncated: {size} bytes, its header needs {need}")
        at = _HEADER.size
        lengths = np.memmap(idx, dtype="<i4", mode="r", offset=at, shape=(n_seq,)) \
            if n_seq else np.zeros(0, dtype="<i4")
        pointers = np.memmap(idx, dtype="<i8", mode="r", offset=at + 4 * n_seq,
                             shape=(n_seq,)) if n_seq else np.zeros(0, dtype="<i8")
        docs = np.memmap(idx, dtype="<i8", mode="r", offset=at + 12 * n_seq, shape=(n_doc,))
        self.n_tokens = int(np.sum(lengths, dtype=np.int64))
        nbytes = self.n_tokens * self.dtype.itemsize
        have = os.path.getsize(bin_)
        if have < nbytes:
            raise ValueError(f"{bin_}: truncated: {have} bytes, its index names {nbytes}")
        if n_seq and (pointers[0] != 0 or int(pointers[-1]) + int(lengths[-1])
                      * self.dtype.itemsize != nbytes):
            raise ValueError(f"{idx}: sequence offsets do not match the sequence lengths")
        if n_doc < 1 or docs[0] != 0 or docs[-1] != n_seq or np.any(np.diff(docs) < 0):
            raise ValueError(f"{idx}: document indices do not run from 0 to {n_seq}")
        self.tokens = np.memmap(bin_, dtype=self.dtype, mode="r", shape=(self.n_tokens,)) \
            if self.n_tokens else np.zeros(0, dtype=self.dtype)
        starts = docs[:-1]
        offsets = np.append(pointers, nbytes)[starts] // self.dtype.itemsize
        self.document_offsets = np.append(offsets, self.n_tokens).astype(np.int64)
        self.files = (bin_, idx)


class NanoGPTFile:
    """nanoGPT's ``train.bin`` / ``val.bin``: uint16 token ids, no header, no documents.
    Not collective."""

    kind = "nanogpt"
    max_id: int | None = None  #: the largest id, once :func:`scan_tokens` has run

    def __init__(self, path: str) -> None:
        self.path = path
        size = os.path.getsize(path)
        if size % 2:
            raise ValueError(f"{path}: {size} bytes is not a whole number of uint16 tokens "
                             "(nanoGPT's .bin); truncated?")
        self.dtype = np.dtype("<u2")
        self.n_tokens = size // 2
        self.tokens = np.memmap(path, dtype=self.dtype, mode="r", shape=(self.n_tokens,)) \
            if self.n_tokens else np.zeros(0, dtype=self.dtype)
        self.document_offsets = None
        self.files = (path,)


def _scan_part(tokens: np.ndarray, blocks: range, per_block: int
               ) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Digests of ``blocks``, id counts, smallest and largest id over them."""
    digests = np.zeros((len(blocks), 32), dtype=np.uint8)
    counts = np.zeros(1, dtype=np.int64)
    lo, hi = np.iinfo(np.int64).max, -1
    step = max(1, _READ_BYTES // tokens.dtype.itemsize)
    for i, b in enumerate(blocks):
        h = hashlib.sha256()
        for a in range(b * per_block, min(len(tokens), (b + 1) * per_block), step):
            chunk = np.asarray(tokens[a:min(a + step, (b + 1) * per_block)])
            h.update(chunk.tobytes())
            lo, hi = min(lo, int(chunk.min())), max(hi, int(chunk.max()))
            if lo < 0:
                continue
            c = count_ids(chunk)
            if c.size > counts.size:
                c[:counts.size] += counts
                counts = c
            else:
                counts[:c.size] += c
        digests[i] = np.frombuffer(h.digest(), dtype=np.uint8)
    return digests, counts, lo, hi


def _scan(source: Any, comm: Any) -> dict[str, Any]:
    """Hash and count ``source``'s tokens between the ranks. Collective."""
    size, rank = size_rank(comm)
    per_block = _BLOCK_BYTES // source.dtype.itemsize
    n_blocks = -(-source.n_tokens // per_block)
    cuts = split_points(n_blocks, min(size, n_blocks)) if n_blocks else [0]
    cuts += [n_blocks] * (size + 1 - len(cuts))
    digests, counts, lo, hi = _scan_part(source.tokens, range(cuts[rank], cuts[rank + 1]),
                                         per_block)
    every = np.zeros(n_blocks * 32, dtype=np.uint8)
    every[cuts[rank] * 32:cuts[rank + 1] * 32] = digests.reshape(-1)
    C.allgather_varied(every, [32 * (cuts[r + 1] - cuts[r]) for r in range(size)], comm=comm)
    ends = C.allreduce(np.array([-lo, hi, counts.size], dtype=np.int64), "max", comm=comm)
    total = np.zeros(int(ends[2]), dtype=np.int64)
    total[:counts.size] = counts
    C.allreduce(total, "sum", comm=comm)
    h = hashlib.sha256(f"{source.kind}/1\0{source.dtype.name}\0".encode())
    h.update(struct.pack("<QQ", source.n_tokens, _BLOCK_BYTES))
    h.update(every.tobytes())
    if source.kind == "megatron":
        with open(source.path + ".idx", "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return {"hash": "sha256:" + h.hexdigest(), "min": int(-ends[0]), "max": int(ends[1]),
            "counts": total.tolist()}


def scan_tokens(source: MegatronFile | NanoGPTFile, *, comm: Any = None) -> dict[str, Any]:
    """The content hash, smallest and largest id and id counts of a Megatron or nanoGPT
    file, from the cache or computed between the ranks (module docstring). Collective over
    ``comm``; every rank returns the same."""
    _, rank = size_rank(comm)
    key = cache_key(source.kind, [file_identity(p) for p in source.files])
    path = os.path.join(cache_dir(), key + ".json")
    found = None
    if rank == 0:
        try:
            import json

            with open(path, encoding="utf-8") as f:
                found = json.load(f)
        except (OSError, ValueError):
            found = None
    found = bcast_json(found, comm)
    if found is not None:
        return found
    result = _scan(source, comm)
    if rank == 0:
        try:
            os.makedirs(cache_dir(), exist_ok=True)
            write_json_atomic(path, result)
        except OSError:
            pass  # no usable cache: computed again next time
    return result
