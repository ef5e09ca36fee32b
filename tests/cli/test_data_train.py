"""Token files as a user runs them: `mpidist prepare` under mpiexec, `mpidist train --data
data.h5`, resume at another world size, `mpidist sample` with the data's tokenizer, and bad
input as one line with exit status 2 and nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from cli_env import cli_env, crashed_at

MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH")
pytest.importorskip("tokenizers")

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--global-batch", "12", "--dtype", "float64", "--eval-interval", "5",
        "--eval-batches", "1", "--no-progress"]
TEXT = ("def main(argv):\n    return parse(argv) or 0\n\nclass Foo:\n    x = 'héllo ✓'\n"
        * 150)


def mpidist(n: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mpidist.cli", *args]
    if n:
        cmd = [MPIEXEC, "-q", "-n", str(n), *cmd]
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=240)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def rows(path: Path) -> dict[int, float]:
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("split", "train") == "train":
            out[r["step"]] = r["loss"]
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    corpus = root / "corpus"
    corpus.mkdir()
    with open(corpus / "docs.jsonl", "w", encoding="utf-8") as f:
        for i in range(60):
            f.write(json.dumps({"text": TEXT[i * 37:i * 37 + 400 + i]}) + "\n")
    (corpus / "long.txt").write_text(TEXT, encoding="utf-8")
    out = mpidist(2, "prepare", str(corpus), "--out", str(root / "data.h5"), "--tokenizer",
                  "bpe:320", "--no-progress").stdout
    assert "mpidist prepare: " in out and "content hash sha256:" in out
    return root


def test_prepare_train_resume_at_another_size_and_sample(prepared: Path, tmp_path: Path):
    data = prepared / "data.h5"
    full = tmp_path / "full"
    mpidist(2, "train", "--data", str(data), "--out", str(full), "--steps", "10",
            "--checkpoint-interval", "5", "--keep", "5", *TINY)
    losses = rows(full / "metrics.jsonl")
    with h5py.File(full / "ckpt-00000010.h5", "r") as f:
        meta = json.loads(f.attrs["metadata_json"])
    extra = meta["extra"]
    with h5py.File(data, "r") as f:
        assert extra["train_config"]["vocab_size"] == f.attrs["vocab_size"] <= 320
        assert extra["data"]["hash"] == f.attrs["content_hash"]
        assert extra["data"]["tokenizer"]["json"] == f["tokenizer"][()].decode()
    # The data moved: resume compares its hash, not its path; 3 ranks continue exactly.
    moved = tmp_path / "elsewhere.h5"
    shutil.copy(data, moved)
    part = crashed_at(full, 5, tmp_path / "part")
    mpidist(3, "train", "--data", str(moved), "--out", str(part), "--steps", "10",
            "--resume", *TINY)
    resumed = rows(part / "metrics.jsonl")
    np.testing.assert_allclose([resumed[s] for s in range(6, 11)],
                               [losses[s] for s in range(6, 11)], rtol=1e-9)
    text = mpidist(0, "sample", str(part), "--prompt", "def main(", "--tokens", "12").stdout
    assert text.startswith("def main(")


def test_resume_with_other_data_is_refused(prepared: Path, tmp_path: Path):
    run = tmp_path / "run"
    mine = tmp_path / "mine.h5"
    shutil.copy(prepared / "data.h5", mine)
    mpidist(2, "train", "--data", str(mine), "--out", str(run), "--steps", "2", *TINY)
    mine.rename(tmp_path / "gone.h5")
    proc = mpidist(2, "train", "--out", str(run), "--steps", "4", "--resume", *TINY,
                   check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"mpidist train: error: data='{mine}': no such file, directory or Megatron prefix "
        f"(the data checkpoint {run}/ckpt-00000002.h5 was trained on; give --data where it "
        "is now)")
    other = tmp_path / "other.h5"
    mpidist(0, "prepare", str(prepared / "corpus" / "long.txt"), "--out", str(other),
            "--tokenizer", "bytes", "--no-progress")
    before = sorted(p.name for p in run.iterdir())
    proc = mpidist(2, "train", "--data", str(other), "--out",
                   str(run), "--steps", "4", "--resume", *TINY, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mpidist train: error: --data {other} "
                                                   "has content hash sha256:"), proc.stderr
    assert "was trained on data with hash" in lines[0]
    assert sorted(p.name for p in run.iterdir()) == before


@pytest.mark.parametrize("case, message", [
    ("vocab", "vocab_size=100 is smaller than the vocabulary of {data}'s tokenizer ({vocab})"),
    ("nanogpt", "--data {nano} (nanogpt's format) names no tokenizer: give its vocabulary "
                "with --vocab-size (GPT-2's is 50257)"),
    ("version", "{bad}: token file format_version=7; this version of mpidist reads "
                "version 1"),
    ("verify", "{bad}: tokens 0-{last} (hash block 0) fail their hash: the file changed "
               "after it was written"),
])
def test_bad_data_is_one_line_and_nothing_is_written(prepared: Path, tmp_path: Path, case,
                                                     message):
    data, nano, bad = prepared / "data.h5", tmp_path / "train.bin", tmp_path / "bad.h5"
    args = ["--data", str(data), "--vocab-size", "100"]
    if case == "nanogpt":
        np.arange(100, dtype=np.uint16).tofile(nano)
        args = ["--data", str(nano)]
    elif case == "version":
        shutil.copy(data, bad)
        with h5py.File(bad, "r+") as f:
            f.attrs["format_version"] = np.int64(7)
        args = ["--data", str(bad)]
    elif case == "verify":
        shutil.copy(data, bad)
        with h5py.File(bad, "r") as f:
            at, last = f["tokens"].id.get_offset(), f["tokens"].shape[0] - 1
        with open(bad, "r+b") as f:
            f.seek(at + 10)
            f.write(b"\x07\x00")
        args = ["--data", str(bad), "--data-verify"]
    out = tmp_path / "run"
    proc = mpidist(2, "train", "--out", str(out), "--steps", "2", *args, *TINY, check=False)
    assert proc.returncode == 2
    with h5py.File(data, "r") as f:
        vocab = int(f.attrs["vocab_size"])
    assert proc.stderr.strip() == "mpidist train: error: " + message.format(
        data=data, nano=nano, bad=bad, vocab=vocab, last=locals().get("last"))
    if case != "verify":  # the hash is read between the ranks once the run has its lock
        assert not out.exists()
    else:
        assert not (out / "metrics.jsonl").exists() and not list(out.glob("ckpt-*"))


def test_prepare_bad_input_under_mpiexec(tmp_path: Path):
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": 3}\n')
    out = tmp_path / "out.h5"
    proc = mpidist(2, "prepare", str(tmp_path / "bad.jsonl"), "--out", str(out),
                   "--tokenizer", "bytes", "--no-progress", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[0] == (
        f"mpidist prepare: error: {tmp_path / 'bad.jsonl'}:2: the record has a non-string "
        "key 'text' (--text-key)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_nanogpt_files_train_and_sample_with_a_tokenizer_given(tmp_path: Path):
    ids = np.frombuffer(TEXT.encode(), dtype=np.uint8).astype(np.uint16)
    cut = len(ids) * 9 // 10
    ids[:cut].tofile(tmp_path / "train.bin")
    ids[cut:].tofile(tmp_path / "val.bin")
    run = tmp_path / "run"
    mpidist(2, "train", "--data", str(tmp_path / "train.bin"), "--vocab-size", "257",
            "--out", str(run), "--steps", "3", *TINY)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("split") == "validation" for r in rows)  # val.bin was used
    proc = mpidist(0, "sample", str(run), "--prompt", "def ", "--tokens", "5", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().endswith(
        "its data (nanogpt's format) named no tokenizer: give --tokenizer tokenizer.json "
        "(the one the data was made with)")
    text = mpidist(0, "sample", str(run), "--prompt", "def ", "--tokens", "5",
                   "--tokenizer", "bytes").stdout
    assert text.startswith("def ")
