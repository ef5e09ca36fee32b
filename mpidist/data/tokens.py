"""Training on token files: mpidist's own (``mpidist prepare``), Megatron's, nanoGPT's.

A :class:`TokenDataset` is a split of a token stream read through a memory map: a sample
is a window of ``block_size + 1`` tokens starting anywhere in the split (``x`` the first
``block_size``, ``y`` the same shifted by one), and its :meth:`TokenDataset.sampler` draws
the global batch of step ``s`` with replacement from ``(seed, s)`` alone
(:class:`~mpidist.data.sampler.WindowSampler`), so neither memory nor start time grows
with the data, and every world size sees the same batches.

Validation: ``--val-data`` (a token file of the same vocabulary), nanoGPT's ``val.bin``
next to a ``train.bin``, or else the documents held out by this rule: the split starts at
the first document that starts at or after token ``floor((1 - TOKEN_VALIDATION_FRACTION) *
n)``, or at that token itself when no document starts after it (a file without documents,
or one long last document). Training uses the tokens before it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpidist.data.external import MegatronFile, NanoGPTFile, megatron_prefix, scan_tokens
from mpidist.data.sampler import WindowSampler, checked_indices, checked_int
from mpidist.data.textfiles import count_ids, entropy, scan_text
from mpidist.data.tokenfile import TokenFile, is_token_file

__all__ = ["TOKEN_VALIDATION_FRACTION", "DataInfo", "TokenDataset", "describe_data",
           "open_token_data", "open_validation", "split_bytes"]

#: Fraction of a token stream (its last documents) held out for validation.
TOKEN_VALIDATION_FRACTION = 0.01


@dataclass(frozen=True)
class DataInfo:
    """What ``--data`` names, found without reading the data."""

    kind: str  #: "text", "tokens" (mpidist's), "megatron" or "nanogpt"
    path: str  #: the file, directory or Megatron prefix
    vocab_size: int | None  #: the data's vocabulary (None: not recorded in the data)

    @property
    def is_tokens(self) -> bool:
        return self.kind != "text"


def describe_data(path: str, *, binary: bool = False) -> DataInfo:
    """Detect and check the data ``path`` names: a Megatron prefix (or its ``.bin`` /
    ``.idx``), an HDF5 token file, a nanoGPT ``*.bin``, else text (a file or directory;
    ``binary``: its bytes as they are). Not collective; reads headers only (and checks a
    text corpus once, cached). Raises ValueError naming the path and what is wrong."""
    if not binary:
        prefix = megatron_prefix(path)
        if prefix is not None:
            MegatronFile(prefix)
            return DataInfo("megatron", prefix, None)
        if os.path.isfile(path) and is_token_file(path):
            return DataInfo("tokens", path, TokenFile(path).vocab_size)
        if os.path.isfile(path) and path.endswith(".bin"):
            NanoGPTFile(path)
            return DataInfo("nanogpt", path, None)
    if not os.path.exists(path):
        raise ValueError(f"data={path!r}: no such file, directory or Megatron prefix")
    scan_text(path, binary=binary)
    return DataInfo("text", path, 256)


def _held_out_start(n_tokens: int, offsets: np.ndarray | None) -> int:
    """First token of the validation split (module docstring)."""
    at = int(np.floor(n_tokens * (1.0 - TOKEN_VALIDATION_FRACTION)))
    if offsets is not None and len(offsets) > 1:
        i = int(np.searchsorted(offsets[:-1], at, side="left"))
        if i < len(offsets) - 1:
            return int(offsets[i])
    return at


def _counts(tokens: np.ndarray, lo: int, hi: int, size: int) -> np.ndarray:
    return count_ids(tokens[lo:hi], size)[:size]


class TokenDataset:
    """Windows of one split of a token stream (module docstring).

    ``len(ds)`` window starts; ``ds.batch(indices) -> (x, y)`` int64 of shape
    ``(len(indices), block_size)``; :meth:`sampler` the training sampler; :meth:`identity`
    what a checkpoint records. Not collective.
    """

    def __init__(self, source: Any, split: str, block_size: int, *, start: int, stop: int,
                 counts: np.ndarray | None, identity: dict[str, Any]) -> None:
        self.block_size = checked_int(block_size, "block_size", 1)
        self.source, self.split = source, split
        self.path = source.path
        self.tokens = source.tokens
        self.split_start, self.split_stop = int(start), int(stop)
        self._all_counts = counts
        self._identity = identity
        self._text_bytes: float | None = None
        n = self.split_stop - self.split_start - self.block_size
        if n < 1:
            raise ValueError(f"{self.path}: its {split} split has {stop - start} tokens, "
                             f"too few for a window of block_size={block_size} + 1 (give "
                             "--val-data, more data or a smaller --block-size)")
        self._n = n

    def __len__(self) -> int:
        return self._n

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and next-token targets of the windows starting at ``indices`` (positions
        in the split), each ``(n, block_size)`` int64."""
        idx = checked_indices(indices, self._n).reshape(-1)
        win = (self.split_start + idx)[:, None] + np.arange(self.block_size + 1)[None, :]
        chunk = np.asarray(self.tokens[win]).astype(np.int64)
        return chunk[:, :-1], chunk[:, 1:]

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.batch(np.array([i]))
        return x[0], y[0]

    def sampler(self, global_batch_size: int, seed: int = 0) -> WindowSampler:
        """The training sampler: windows drawn with replacement from ``(seed, step)``."""
        return WindowSampler(self._n, global_batch_size, seed=seed)

    def split_counts(self) -> np.ndarray | None:
        """Occurrences of each id in this split (None when the data has no counts)."""
        if self._all_counts is None:
            return None
        counts = self._all_counts.copy()
        n = len(self.tokens)
        for lo, hi in ((0, self.split_start), (self.split_stop, n)):
            if hi > lo:
                counts -= _counts(self.tokens, lo, hi, counts.size)
        return counts

    def unigram_baseline(self) -> float:
        """Entropy (nats) of the id frequencies of this split (NaN when the data has no
        counts)."""
        counts = self.split_counts()
        return float("nan") if counts is None else entropy(counts)

    def set_text_bytes(self, n_bytes: float) -> None:
        """Give the UTF-8 bytes of the text this split's tokens encode (``--val-bytes``)."""
        if not n_bytes > 0:
            raise ValueError(f"{self.path}: text bytes {n_bytes!r} must be positive")
        self._text_bytes = float(n_bytes)

    def text_bytes(self) -> float:
        """UTF-8 bytes of the text this split's tokens encode: from the documents' byte
        lengths the data records (a document cut by the split counted in proportion to its
        tokens), or :meth:`set_text_bytes`; NaN when neither."""
        if self._text_bytes is None:
            self._text_bytes = split_bytes(self.source, self.split_start, self.split_stop)
        return self._text_bytes

    def bytes_per_token(self) -> float:
        """UTF-8 bytes of text per token of this split (NaN when unknown): validation loss
        in bits per byte is ``loss / (ln 2 * bytes_per_token)``."""
        return self.text_bytes() / (self.split_stop - self.split_start)

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records about the data: kind, content hash, tokenizer."""
        return dict(self._identity)

    def __repr__(self) -> str:
        return (f"TokenDataset({self.path!r}, split={self.split!r}, tokens="
                f"{self.split_stop - self.split_start}, windows={self._n})")


def _bytes_from(doc_bytes: np.ndarray, total: int, k: int) -> int:
    """Bytes of documents ``k`` on, reading the shorter side of the array."""
    n = len(doc_bytes)
    if k > n // 2:
        return int(np.asarray(doc_bytes[k:]).sum())
    return total - int(np.asarray(doc_bytes[:k]).sum())


def split_bytes(source: Any, start: int, stop: int) -> float:
    """UTF-8 bytes of the text of tokens ``[start, stop)`` of ``source``: whole documents
    by their recorded lengths, a document cut at ``start`` or ``stop`` in proportion to its
    tokens; NaN when the source records no document lengths. Reads the document lengths of
    the shorter side of the cut. Not collective."""
    doc_bytes = getattr(source, "document_bytes", None)
    offsets = source.document_offsets
    if doc_bytes is None or offsets is None or len(offsets) < 2 or stop <= start:
        return float("nan")
    total = int(source.n_bytes)
    first = int(np.searchsorted(offsets, start, side="right")) - 1
    end = int(np.searchsorted(offsets, stop, side="left"))  # documents starting before stop
    inside = _bytes_from(doc_bytes, total, first) - _bytes_from(doc_bytes, total, end)
    cut = 0.0
    for d, lo, hi in ((first, int(offsets[first]), start), (end - 1, stop, int(offsets[end]))):
        doc_tokens = int(offsets[d + 1]) - int(offsets[d])
        if hi > lo and doc_tokens:
            cut += int(doc_bytes[d]) * (hi - lo) / doc_tokens
    return float(inside - cut)


def _open_source(info: DataInfo, comm: Any) -> tuple[Any, dict[str, Any], np.ndarray | None]:
    """The opened file, its identity and its id counts. Collective (external scans)."""
    if info.kind == "tokens":
        tf = TokenFile(info.path)
        ident = {"kind": "tokens", "hash": tf.content_hash,
                 "tokenizer": tf.tokenizer_record()}
        return tf, ident, tf.token_counts
    src = MegatronFile(info.path) if info.kind == "megatron" else NanoGPTFile(info.path)
    scan = scan_tokens(src, comm=comm)
    if src.n_tokens and scan["min"] < 0:
        raise ValueError(f"{info.path}: holds the negative token id {scan['min']}")
    src.max_id = scan["max"]
    ident = {"kind": info.kind, "hash": scan["hash"], "tokenizer": None}
    return src, ident, np.asarray(scan["counts"], dtype=np.int64)


def open_token_data(info: DataInfo, block_size: int, *, val: DataInfo | None = None,
                    comm: Any = None, val_bytes: float | None = None
                    ) -> tuple[TokenDataset, TokenDataset]:
    """The train and validation splits of a token file (module docstring).

    Collective over ``comm`` (a Megatron or nanoGPT file is hashed between the ranks the
    first time it is used). ``val_bytes``: the UTF-8 bytes of the validation text, for
    data that records none (``--val-bytes``). Raises the same ValueError on every rank for
    a split too small for one window or a ``val`` of another tokenizer.
    """
    src, ident, counts = _open_source(info, comm)
    n = src.n_tokens
    if val is None and info.kind == "nanogpt" and os.path.basename(info.path) == "train.bin":
        sibling = os.path.join(os.path.dirname(info.path), "val.bin")
        if os.path.isfile(sibling):
            val = DataInfo("nanogpt", sibling, None)
    if val is None:
        cut = _held_out_start(n, src.document_offsets)
        ident["validation"] = f"held out from token {cut}"
        train = TokenDataset(src, "train", block_size, start=0, stop=cut, counts=counts,
                             identity=ident)
        valid = TokenDataset(src, "validation", block_size, start=cut, stop=n, counts=None,
                             identity=ident)
    else:
        valid = open_validation(val, block_size, ident, data=info.path, comm=comm)
        train = TokenDataset(src, "train", block_size, start=0, stop=n, counts=counts,
                             identity=ident)
    if val_bytes is not None:
        valid.set_text_bytes(val_bytes)
    return train, valid


def open_validation(val: DataInfo, block_size: int, identity: dict[str, Any], *, data: str,
                    comm: Any = None) -> TokenDataset:
    """The whole token file ``val`` as the validation split of ``data`` (whose identity,
    updated here, is ``identity``). Collective over ``comm`` as :func:`open_token_data`;
    ValueError when its tokenizer is not ``data``'s."""
    vsrc, vident, _ = _open_source(val, comm)
    mine, theirs = identity.get("tokenizer"), vident.get("tokenizer")
    if (mine or {}).get("json") != (theirs or {}).get("json"):
        raise ValueError(f"--val-data {val.path}: its tokenizer differs from that of "
                         f"--data {data}")
    identity["validation"] = vident["hash"]
    return TokenDataset(vsrc, "validation", block_size, start=0, stop=vsrc.n_tokens,
                        counts=None, identity=identity)


def largest_id(ds: TokenDataset) -> int:
    """The largest token id of the data behind ``ds`` (-1 when it has none)."""
    src = ds.source
    if getattr(src, "max_id", None) is not None:
        return int(src.max_id)
    counts = getattr(src, "token_counts", None)
    nz = np.flatnonzero(counts) if counts is not None else np.zeros(0)
    return int(nz[-1]) if nz.size else -1
