"""Validation loss in bits per byte: the bytes of a split from the documents' recorded
lengths, against a hand computation on tiny files (every token counted from the texts
and the `tokenizers` library itself), in metrics.jsonl and summary.json; `--val-bytes`
for a Megatron file; a file without document lengths still reads, without bits per byte."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
from cli_env import cli_env
from token_helpers import write_megatron

from mpidist.data.prepare import prepare
from mpidist.data.tokenfile import TokenFile
from mpidist.data.tokens import (
    TOKEN_VALIDATION_FRACTION,
    describe_data,
    open_token_data,
    split_bytes,
)

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8",
        "--global-batch", "6", "--dtype", "float64", "--eval-interval", "2",
        "--eval-batches", "2", "--no-progress", "--steps", "2"]
#: Documents with one-, two-, three- and four-byte characters.
DOCS = [("déf f(x):\n  return x×2 ✓ " + "東京"[i % 2] + "🙂" * (i % 3)) * (1 + i % 2)
        for i in range(300)]


def train(out: Path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "mpidist.cli", "train", "--out", str(out),
                           *args, *TINY], env=cli_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {"rows": [r for r in rows if r.get("split") == "validation"],
            "summary": summary, "stdout": proc.stdout}


def test_split_bytes_by_hand():
    # documents of 4, 6 and 10 tokens holding 10, 12 and 30 bytes
    src = SimpleNamespace(document_offsets=np.array([0, 4, 10, 20]),
                          document_bytes=np.array([10, 12, 30]), n_bytes=52)
    assert split_bytes(src, 0, 20) == 52
    assert split_bytes(src, 4, 20) == 42
    assert split_bytes(src, 10, 20) == 30
    assert split_bytes(src, 15, 20) == 15  # half of the last document
    assert split_bytes(src, 2, 7) == 10 / 2 + 12 / 2  # the ends of two documents
    assert split_bytes(src, 11, 13) == 30 * 2 / 10  # inside one
    assert math.isnan(split_bytes(SimpleNamespace(document_offsets=np.array([0, 5]),
                                                  n_bytes=0), 0, 5))


def _by_hand(texts: list[str], count) -> tuple[int, int]:
    """Tokens and bytes of the held-out split, from the texts: each document's tokens
    (``count``) plus its end-of-document token, the split starting at the first document
    that starts at or after floor(0.99 * n)."""
    tokens = [count(t) + 1 for t in texts]
    starts = np.concatenate([[0], np.cumsum(tokens)])
    n = int(starts[-1])
    cut = math.floor(n * (1 - TOKEN_VALIDATION_FRACTION))
    first = next(i for i, s in enumerate(starts[:-1]) if s >= cut)
    return n - int(starts[first]), sum(len(t.encode("utf-8")) for t in texts[first:])


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_bits_per_byte_against_a_hand_computation(tmp_path: Path, tokenizer: str):
    lib = pytest.importorskip("tokenizers") if tokenizer != "bytes" else None
    text = tmp_path / "docs.txt"
    text.write_text("\n\n".join(DOCS), encoding="utf-8")
    data = tmp_path / "data.h5"
    prepare([str(text)], str(data), tokenizer, separator="\n\n")
    if lib is None:
        def count(t: str) -> int:
            return len(t.encode("utf-8"))
    else:
        with h5py.File(data, "r") as f:
            library = lib.Tokenizer.from_str(f["tokenizer"][()].decode())

        def count(t: str) -> int:
            return len(library.encode(t, add_special_tokens=False).ids)
    n_tokens, n_bytes = _by_hand(DOCS, count)
    _, valid = open_token_data(describe_data(str(data)), 8)
    assert (valid.split_stop - valid.split_start, valid.text_bytes()) == (n_tokens, n_bytes)
    if lib is not None:
        assert n_bytes / n_tokens > 1.3  # BPE tokens hold several bytes
    run = train(tmp_path / "run", "--data", str(data))
    for row in run["rows"]:
        want = row["loss"] * n_tokens / (n_bytes * math.log(2))
        assert math.isclose(row["bits_per_byte"], want, rel_tol=1e-12)
    s = run["summary"]
    assert math.isclose(s["final_validation_bits_per_byte"],
                        s["final_validation_loss"] * n_tokens / (n_bytes * math.log(2)),
                        rel_tol=1e-12)
    assert "validation bits/byte  " in run["stdout"]


def test_text_data_is_its_bytes_and_megatron_needs_val_bytes(tmp_path: Path):
    corpus = tmp_path / "plain.txt"
    corpus.write_text("".join(DOCS), encoding="utf-8")
    run = train(tmp_path / "text", "--data", str(corpus))
    for row in run["rows"]:  # byte tokens: one byte each
        assert math.isclose(row["bits_per_byte"], row["loss"] / math.log(2), rel_tol=1e-12)
    prefix = tmp_path / "meg"
    ids = np.frombuffer("".join(DOCS).encode(), dtype=np.uint8)
    write_megatron(prefix, [[ids[i:i + 500]] for i in range(0, ids.size, 500)])
    plain = train(tmp_path / "meg-run", "--data", str(prefix), "--vocab-size", "256")
    assert all("bits_per_byte" not in r for r in plain["rows"])
    assert plain["summary"]["final_validation_bits_per_byte"] is None
    assert "bits/byte" not in plain["stdout"]
    _, valid = open_token_data(describe_data(str(prefix)), 8)
    n_val = valid.split_stop - valid.split_start
    given = train(tmp_path / "meg-given", "--data", str(prefix), "--vocab-size", "256",
                  "--val-bytes", str(3 * n_val))
    for row in given["rows"]:
        assert math.isclose(row["bits_per_byte"], row["loss"] / (3 * math.log(2)),
                            rel_tol=1e-12)


def test_a_token_file_without_document_lengths_reads_without_bits_per_byte(tmp_path: Path):
    text = tmp_path / "docs.txt"
    text.write_text("\n\n".join(DOCS), encoding="utf-8")
    data = tmp_path / "data.h5"
    prepare([str(text)], str(data), "bytes", separator="\n\n")
    with h5py.File(data, "r+") as f:  # as a writer that records none would leave it
        del f["document_bytes"]
    assert TokenFile(str(data)).document_bytes is None
    train_split, valid = open_token_data(describe_data(str(data)), 8)
    assert math.isnan(valid.bytes_per_token()) and len(train_split) > 0
