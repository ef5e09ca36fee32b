"""Tokenizers of token files: ``bytes``, ``bpe:V`` and a user's ``tokenizer.json``.

Every tokenizer is kept as HF ``tokenizers`` JSON (in the token file and in checkpoints),
so any of them loads with ``tokenizers.Tokenizer.from_str``. The ``tokenizers`` library is
imported only where text is tokenized with a trained or user vocabulary, never at import
time, and never asked to download anything (no ``from_pretrained``).

* ``bytes``: token id = byte value of the UTF-8 text (0-255), plus the end-of-document id
  256 (``<|endoftext|>``): vocabulary 257. Encoded with NumPy; its JSON is a byte-level BPE
  without merges whose vocabulary orders the bytes by value, so the library encodes the
  same ids (any text, ``<|endoftext|>`` included, is its bytes).
* ``bpe:V``: a byte-level BPE of at most ``V`` tokens (GPT-2's pre-tokenizer, no prefix
  space), trained with the library on a sample of the corpus (:mod:`mpidist.data.prepare`
  documents which); ``<|endoftext|>`` is id 0.
* a path: a ``tokenizer.json`` the user brings. Its end-of-document token is the first of
  :data:`EOD_NAMES` in its vocabulary (none: documents are not separated by a token, their
  boundaries are still recorded).

Documents are encoded without the tokenizer's own special tokens (``add_special_tokens``
off) and with the text of a special token inside a document encoded as text
(``encode_special_tokens``: a document cannot end itself early), and long ones in pieces
cut just before a newline that follows an ASCII letter or digit: a byte-level
pre-tokenizer (GPT-2's and Llama 3's patterns) never joins across such a place, so the
pieces encode exactly as the whole document. Other tokenizers encode whole documents.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["EOD_NAMES", "EOD_TEXT", "MAX_VOCAB", "PIECE_BYTES", "Tokenizer", "bytes_json",
           "load_tokenizer", "parse_tokenizer_arg", "train_bpe"]

#: The end-of-document token of ``bytes`` and ``bpe:V``.
EOD_TEXT = "<|endoftext|>"
#: Names taken as the end-of-document token of a user's tokenizer, in this order.
EOD_NAMES = (EOD_TEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
#: The largest vocabulary a token file holds (uint32 ids).
MAX_VOCAB = 1 << 32
#: Longest piece of a document encoded at once.
PIECE_BYTES = 1 << 20
#: Smallest vocabulary of ``bpe:V``: the 256 bytes and the end-of-document token.
MIN_BPE_VOCAB = 257

_CUT = re.compile(r"(?<=[A-Za-z0-9])\n")
_LOCAL_NORMALIZERS = (None, "NFC", "NFD", "NFKC", "NFKD", "Lowercase")


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in of every byte value, indexed by the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def bytes_json() -> str:
    """The ``bytes`` tokenizer as ``tokenizers`` JSON (built without the library)."""
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}
    model = {"type": "BPE", "dropout": None, "unk_token": None,
             "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": False,
             "byte_fallback": False, "ignore_merges": False,
             "vocab": {**{s: i for i, s in enumerate(_byte_symbols())}, EOD_TEXT: 256},
             "merges": []}
    # The end-of-document token is a vocabulary entry that no merge makes, not an added
    # token: the library would otherwise turn the text "<|endoftext|>" into id 256.
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": None, "pre_tokenizer": level, "post_processor": None,
            "decoder": dict(level, use_regex=True), "model": model}
    return json.dumps(spec, ensure_ascii=False, sort_keys=True)


def _library(single_thread: bool) -> Any:
    """The ``tokenizers`` module; one thread per process when ``single_thread`` (set before
    the library starts its pool; a value the user set is kept)."""
    if single_thread:
        os.environ.setdefault("RAYON_NUM_THREADS", "1")
    try:
        import tokenizers
    except ImportError:
        raise ValueError("this tokenizer needs the HF tokenizers library: pip install "
                         "'mpidist[data]' (or pip install tokenizers)") from None
    return tokenizers


def _piecewise(spec: dict[str, Any]) -> bool:
    """Whether documents may be encoded in pieces cut before letter/digit + newline."""
    def types(node: Any) -> list[dict[str, Any]]:
        if not isinstance(node, dict):
            return []
        if node.get("type") == "Sequence":
            inner = node.get("pretokenizers") or node.get("normalizers") or []
            return [t for n in inner for t in types(n)]
        return [node]

    pre = types(spec.get("pre_tokenizer"))
    level = [p for p in pre if p.get("type") == "ByteLevel"]
    if not level or any(p.get("add_prefix_space") for p in level):
        return False
    if any(p.get("type") not in ("ByteLevel", "Split", "Digits", "Punctuation") for p in pre):
        return False
    if not any(p.get("type") == "Split" or p.get("use_regex", True) for p in pre):
        return False  # one pre-token per text: merges could join across any cut
    norm = spec.get("normalizer")
    return all(n.get("type") in _LOCAL_NORMALIZERS for n in types(norm)) if norm else True


def split_pieces(text: str, limit: int = PIECE_BYTES) -> list[str]:
    """``text`` cut into pieces of about ``limit`` characters or fewer where the encoding
    allows (before a newline that follows an ASCII letter or digit); a piece with no such
    place stays longer. Pure."""
    if len(text) <= limit:
        return [text]
    pieces, start = [], 0
    while len(text) - start > limit:
        cut = None
        for m in _CUT.finditer(text, start + 1, start + limit + 1):
            cut = m.start()
        if cut is None:
            m = _CUT.search(text, start + limit + 1)
            if m is None:
                break
            cut = m.start()
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


class Tokenizer:
    """A tokenizer of token files: its name, JSON, vocabulary and end-of-document id.

    Built by :func:`load_tokenizer` (from the ``--tokenizer`` argument), :func:`train_bpe`
    or :meth:`from_record` (a token file's or checkpoint's record). Not collective.
    """

    def __init__(self, name: str, spec_json: str, *, vocab_size: int | None = None,
                 eod_id: int | None = None, single_thread: bool = False) -> None:
        self.name = name
        self.json = spec_json
        self._single = single_thread
        self._lib: Any = None
        try:
            spec = json.loads(spec_json)
        except ValueError as exc:
            raise ValueError(f"tokenizer {name!r}: its JSON does not parse: {exc}") from None
        self.is_bytes = name == "bytes"
        self.piecewise = self.is_bytes or _piecewise(spec)
        if vocab_size is None or (eod_id is None and not self.is_bytes):
            lib = self.library()
            vocab_size = lib.get_vocab_size(with_added_tokens=True)
            found = [lib.token_to_id(t) for t in EOD_NAMES]
            eod_id = next((i for i in found if i is not None), None)
        if vocab_size >= MAX_VOCAB:
            raise ValueError(f"tokenizer {name!r} has a vocabulary of {vocab_size} tokens, "
                             f"more than a token file holds (uint32 ids: {MAX_VOCAB - 1})")
        self.vocab_size = int(vocab_size)
        self.eod_id = None if eod_id is None else int(eod_id)

    @classmethod
    def from_record(cls, record: dict[str, Any], *, single_thread: bool = False
                    ) -> Tokenizer:
        """The tokenizer of a record made by :meth:`record`."""
        return cls(str(record["name"]), str(record["json"]),
                   vocab_size=int(record["vocab_size"]),
                   eod_id=None if record.get("eod_id") is None else int(record["eod_id"]),
                   single_thread=single_thread)

    def record(self) -> dict[str, Any]:
        """Name, vocabulary size, end-of-document id and JSON (JSON-able)."""
        return {"name": self.name, "vocab_size": self.vocab_size, "eod_id": self.eod_id,
                "json": self.json}

    @property
    def dtype(self) -> np.dtype:
        """uint16 when every id fits, else uint32."""
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def library(self) -> Any:
        """The ``tokenizers.Tokenizer`` of this JSON (loaded on first use)."""
        if self._lib is None:
            lib = _library(self._single)
            try:
                tok = lib.Tokenizer.from_str(self.json)
            except Exception as exc:  # noqa: BLE001 - the library raises its own types
                raise ValueError(f"tokenizer {self.name!r} does not load: {exc}") from None
            tok.encode_special_tokens = True  # a document cannot end itself early
            self._lib = tok
        return self._lib

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text's token ids (int64), without special tokens or end-of-document id."""
        if self.is_bytes:
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64)
                    for t in texts]
        pieces: list[str] = []
        owner: list[int] = []
        for i, t in enumerate(texts):
            parts = split_pieces(t) if self.piecewise else [t]
            pieces += parts
            owner += [i] * len(parts)
        lib = self.library()
        encode = getattr(lib, "encode_batch_fast", lib.encode_batch)
        done = encode(pieces, add_special_tokens=False)
        out: list[list[np.ndarray]] = [[] for _ in texts]
        for i, enc in zip(owner, done, strict=True):
            out[i].append(np.asarray(enc.ids, dtype=np.int64))
        return [np.concatenate(parts) if len(parts) != 1 else parts[0] for parts in out]

    def encode(self, text: str) -> np.ndarray:
        """The ids of ``text`` (int64)."""
        return self.encode_documents([text])[0]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of ``ids``; the end-of-document token becomes a newline; ids outside the
        vocabulary raise ValueError."""
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids,
                         dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        if self.is_bytes:
            arr = np.where(arr == 256, 10, arr)
            return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        parts, start = [], 0
        stops = np.flatnonzero(arr == self.eod_id) if self.eod_id is not None else []
        for stop in [*stops, arr.size]:
            parts.append(self.library().decode(arr[start:stop].tolist(),
                                                skip_special_tokens=False))
            start = stop + 1
        return "\n".join(parts)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


def parse_tokenizer_arg(arg: str) -> tuple[str, int | None]:
    """``("bytes", None)``, ``("bpe", V)`` or ``("file", None)`` for a ``--tokenizer``
    value; ValueError naming it when it is none of them. Pure (a file is checked when
    loaded)."""
    if arg == "bytes":
        return "bytes", None
    if arg.startswith("bpe:"):
        v = arg[4:]
        if not v.isdigit() or int(v) < MIN_BPE_VOCAB:
            raise ValueError(f"--tokenizer {arg!r}: bpe:V needs an integer V >= "
                             f"{MIN_BPE_VOCAB} (the 256 bytes and <|endoftext|>)")
        if int(v) >= MAX_VOCAB:
            raise ValueError(f"--tokenizer {arg!r}: V must be below {MAX_VOCAB} (uint32 ids)")
        return "bpe", int(v)
    return "file", None


def load_tokenizer(arg: str, *, single_thread: bool = False) -> Tokenizer:
    """The ``bytes`` tokenizer or a user's ``tokenizer.json`` (``bpe:V`` is trained by
    :func:`train_bpe`). ValueError naming the file when it does not load. Not collective."""
    kind, _ = parse_tokenizer_arg(arg)
    if kind == "bytes":
        return Tokenizer("bytes", bytes_json(), vocab_size=257, eod_id=256)
    if kind == "bpe":
        raise ValueError(f"--tokenizer {arg}: a BPE is trained on the corpus by prepare")
    try:
        with open(arg, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--tokenizer {arg!r} cannot be read: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None
    try:
        tok = Tokenizer(f"file:{os.path.basename(arg)}", text, single_thread=single_thread)
        tok.library()
    except ValueError as exc:
        raise ValueError(f"--tokenizer {arg!r} does not load as a tokenizers JSON file: "
                         f"{str(exc).split(': ', 1)[-1]}") from None
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int, *, single_thread: bool = False
              ) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` tokens trained on ``texts`` (deterministic
    for the same texts and library version; ``<|endoftext|>`` is id 0). Not collective."""
    lib = _library(single_thread)
    tok = lib.Tokenizer(lib.models.BPE())
    tok.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = lib.decoders.ByteLevel()
    trainer = lib.trainers.BpeTrainer(
        vocab_size=int(vocab_size), special_tokens=[EOD_TEXT], show_progress=False,
        initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    spec = tok.to_str()
    return Tokenizer(f"bpe:{vocab_size}", spec, vocab_size=tok.get_vocab_size(),
                     eod_id=tok.token_to_id(EOD_TEXT), single_thread=single_thread)
