"""`prepare` in one process: what the token file holds, the tokenizers against the
`tokenizers` library's own encoding, and every bad input refused with nothing written."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from token_helpers import TEXTS, write_corpus

from mpidist.data.prepare import prepare
from mpidist.data.tokenfile import TokenFile, verify_token_file
from mpidist.data.tokenizer import (
    Tokenizer,
    load_tokenizer,
    parse_tokenizer_arg,
    split_pieces,
    train_bpe,
)

tokenizers = pytest.importorskip("tokenizers")


def _library(tok: Tokenizer):
    """The library's tokenizer of ``tok``, special tokens' text encoded as text."""
    lib = tokenizers.Tokenizer.from_str(tok.json)
    lib.encode_special_tokens = True
    return lib


def _expected_stream(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """Each document encoded whole by the library, then the end-of-document id."""
    lib = _library(tok)
    parts = []
    for d in docs:
        parts.append(np.array(lib.encode(d, add_special_tokens=False).ids, dtype=np.int64))
        if tok.eod_id is not None:
            parts.append(np.array([tok.eod_id]))
    return np.concatenate(parts)


def _all_docs(docs: dict[str, list[str]]) -> list[str]:
    return [d for name in sorted(docs) for d in docs[name]]


@pytest.mark.parametrize("spec", ["bytes", "bpe:400"])
def test_prepare_writes_the_library_encoding_of_every_document(tmp_path: Path, spec: str):
    docs = write_corpus(tmp_path / "corpus")
    out = tmp_path / "data.h5"
    summary = prepare([str(tmp_path / "corpus")], str(out), spec)
    tf = TokenFile(str(out))
    tok = Tokenizer.from_record(tf.tokenizer_record())
    want = _expected_stream(tok, _all_docs(docs))
    np.testing.assert_array_equal(np.asarray(tf.tokens), want)
    assert tf.n_documents == summary["n_documents"] == sum(len(v) for v in docs.values())
    lengths = [len(_library(tok).encode(d, add_special_tokens=False).ids) + 1
               for d in _all_docs(docs)]
    np.testing.assert_array_equal(np.diff(tf.document_offsets), lengths)
    assert tf.vocab_size == (257 if spec == "bytes" else 400) and tf.eod_id is not None
    np.testing.assert_array_equal(tf.token_counts, np.bincount(want, minlength=tf.vocab_size))
    with h5py.File(out, "r") as f:
        assert f.attrs["format"] == "mpidist-tokens" and f.attrs["format_version"] == 1
        names = [p.decode() if isinstance(p, bytes) else p for p in f["sources/path"][...]]
        assert names == [f"corpus/{n}" for n in sorted(docs)]
        np.testing.assert_array_equal(f["sources/documents"][...],
                                      [len(docs[n]) for n in sorted(docs)])
        np.testing.assert_array_equal(f["document_bytes"][...],
                                      [len(d.encode()) for d in _all_docs(docs)])
        assert f["tokens"].dtype == np.uint16
    verify_token_file(str(out))  # the content hash holds
    for t in _all_docs(docs):
        assert tok.decode(tok.encode(t)) == t  # round trip


def test_bytes_tokenizer_is_the_byte_values_and_the_library_agrees():
    tok = load_tokenizer("bytes")
    text = "naïve café — 東京 ✓\n<|endoftext|>\x00" + "".join(map(chr, range(300)))
    ids = tok.encode(text)
    np.testing.assert_array_equal(ids, np.frombuffer(text.encode(), dtype=np.uint8))
    assert _library(tok).encode(text, add_special_tokens=False).ids == ids.tolist()
    assert (tok.vocab_size, tok.eod_id) == (257, 256)


def test_long_documents_are_encoded_in_pieces_exactly_as_whole():
    text = "".join(TEXTS) * 30
    tok = train_bpe([text], 500)
    whole = _library(tok).encode(text, add_special_tokens=False).ids
    pieces = split_pieces(text, 700)
    assert len(pieces) > 20 and "".join(pieces) == text
    got = np.concatenate([_library(tok).encode(p, add_special_tokens=False).ids
                          for p in pieces])
    np.testing.assert_array_equal(got, whole)


def test_one_long_text_file_is_streamed_as_one_document(tmp_path: Path):
    text = "".join(TEXTS) * 400  # several MiB-size pieces of the reader
    (tmp_path / "book.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "book.h5"
    tok = train_bpe([text[:20000]], 300)
    (tmp_path / "tok.json").write_text(tok.json, encoding="utf-8")
    prepare([str(tmp_path / "book.txt")], str(out), str(tmp_path / "tok.json"))
    tf = TokenFile(str(out))
    assert tf.n_documents == 1 and tf.tokenizer_name == "file:tok.json"
    np.testing.assert_array_equal(np.asarray(tf.tokens), _expected_stream(tok, [text]))


def test_separator_splits_text_files_into_documents(tmp_path: Path):
    (tmp_path / "a.txt").write_text("one\n\n\n\ntwo\n\n\nthree\n\n", encoding="utf-8")
    out = tmp_path / "a.h5"
    prepare([str(tmp_path / "a.txt")], str(out), "bytes", separator="\n\n")
    tf = TokenFile(str(out))
    # leftmost occurrences without overlap: "one", "" (skipped), "two", "\nthree"
    want = [b"one", b"two", b"\nthree"]
    got = [bytes(np.asarray(tf.tokens[a:b - 1]).astype(np.uint8))
           for a, b in zip(tf.document_offsets[:-1], tf.document_offsets[1:], strict=True)]
    assert got == want


def test_directories_skip_hidden_and_count_files_that_are_not_text(tmp_path: Path):
    root = tmp_path / "d"
    (root / ".git").mkdir(parents=True)
    (root / ".git" / "config").write_text("hidden")
    (root / ".hidden.txt").write_text("hidden")
    (root / "a.txt").write_text("text a\n")
    (root / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    summary = prepare([str(root)], str(tmp_path / "d.h5"), "bytes")
    assert summary["n_documents"] == 1 and summary["skipped"] == 1
    with h5py.File(tmp_path / "d.h5", "r") as f:
        assert [s.decode() if isinstance(s, bytes) else s for s in f["skipped"][...]] == \
            ["d/b.png"]


def _no_litter(tmp_path: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p for p in os.listdir(out.parent) if ".tmp-" in p]


@pytest.mark.parametrize("case, message", [
    ("empty", r"empty\.txt: the input is empty"),
    ("not-json", r"bad\.jsonl:3: not JSON"),
    ("no-key", r"bad\.jsonl:2: the record lacks key 'text' \(--text-key\)"),
    ("binary", r"blob\.txt is not text \(not valid UTF-8 at byte 128\)"),
    ("bad-utf8-gz", r"bad\.txt\.gz is not text \(not valid UTF-8 at byte 3\)"),
    ("tokenizer", r"--tokenizer '.*tok\.json' does not load as a tokenizers JSON file"),
    ("vocab", r"bpe:V needs an integer V >= 257"),
    ("missing", r"nothere: no such file or directory"),
])
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path: Path, case: str, message: str):
    src = tmp_path / "in"
    src.mkdir()
    tokenizer = "bytes"
    if case == "empty":
        (src / "empty.txt").write_bytes(b"")
        inputs = [src / "empty.txt"]
    elif case in ("not-json", "no-key"):
        lines = ['{"text": "a"}', '{"text": "b"}', "{not json"] if case == "not-json" else \
            ['{"text": "a"}', '{"body": "b"}']
        (src / "bad.jsonl").write_text("\n".join(lines) + "\n")
        inputs = [src / "bad.jsonl"]
    elif case == "binary":
        (src / "blob.txt").write_bytes(bytes(range(256)) * 4)
        inputs = [src / "blob.txt"]
    elif case == "bad-utf8-gz":
        with gzip.open(src / "bad.txt.gz", "wb") as f:
            f.write(b"abc\xff\xfe")
        inputs = [src / "bad.txt.gz"]
    elif case == "tokenizer":
        (src / "a.txt").write_text("text")
        (src / "tok.json").write_text(json.dumps({"model": {"type": "Nonsense"}}))
        inputs, tokenizer = [src / "a.txt"], str(src / "tok.json")
    elif case == "vocab":
        (src / "a.txt").write_text("text")
        inputs, tokenizer = [src / "a.txt"], "bpe:12"
    else:
        inputs = [src / "nothere"]
    out = tmp_path / "out.h5"
    with pytest.raises(ValueError, match=message):
        prepare([str(p) for p in inputs], str(out), tokenizer)
    _no_litter(tmp_path, out)


def test_an_existing_output_is_refused_unless_overwrite(tmp_path: Path):
    (tmp_path / "a.txt").write_text("some text\n")
    out = tmp_path / "a.h5"
    out.write_bytes(b"precious")
    with pytest.raises(ValueError, match=r"exists; give --overwrite to replace it"):
        prepare([str(tmp_path / "a.txt")], str(out), "bytes")
    assert out.read_bytes() == b"precious"
    prepare([str(tmp_path / "a.txt")], str(out), "bytes", overwrite=True)
    assert TokenFile(str(out)).n_tokens == len("some text\n") + 1


def test_vocabularies_beyond_uint32_are_refused():
    with pytest.raises(ValueError, match=r"V must be below 4294967296"):
        parse_tokenizer_arg("bpe:4294967296")
    with pytest.raises(ValueError, match=r"more than a token file holds \(uint32 ids"):
        Tokenizer("big", "{}", vocab_size=1 << 32, eod_id=0)


def _prepared(tmp_path: Path) -> Path:
    (tmp_path / "a.txt").write_text("".join(TEXTS) * 5, encoding="utf-8")
    out = tmp_path / "a.h5"
    prepare([str(tmp_path / "a.txt")], str(out), "bytes")
    return out


def test_a_changed_token_file_fails_its_hash(tmp_path: Path):
    out = _prepared(tmp_path)
    tf = TokenFile(str(out))
    at = tf.tokens.offset + 2 * 100  # token 100
    with open(out, "r+b") as f:
        f.seek(at)
        f.write(b"\x01\x01")
    with pytest.raises(ValueError, match=r"a\.h5: tokens 0-\d+ \(hash block 0\) fail their "
                                         r"hash"):
        verify_token_file(str(out))


def test_a_truncated_token_file_is_refused(tmp_path: Path):
    out = _prepared(tmp_path)
    size = out.stat().st_size
    with open(out, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(ValueError, match=r"a\.h5: (truncated|not a readable HDF5 token file)"):
        TokenFile(str(out))


def test_an_unknown_format_version_is_refused(tmp_path: Path):
    out = _prepared(tmp_path)
    with h5py.File(out, "r+") as f:
        f.attrs["format_version"] = np.int64(99)
    with pytest.raises(ValueError, match=r"token file format_version=99; this version of "
                                         r"mpidist reads version 1"):
        TokenFile(str(out))
