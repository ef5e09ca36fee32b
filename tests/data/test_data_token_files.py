"""Reading token files: Megatron's and nanoGPT's as their tools write them, the windows and
the held-out rule, sampling with replacement, and plain text of any size in constant
memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from token_helpers import TEXTS, write_megatron, write_nanogpt

from mpidist.data.external import MegatronFile, scan_tokens
from mpidist.data.prepare import prepare
from mpidist.data.sampler import GlobalBatchSampler, WindowSampler, feistel_permute
from mpidist.data.tokens import (
    TOKEN_VALIDATION_FRACTION,
    describe_data,
    largest_id,
    open_token_data,
)


def _docs(n: int, seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 50000, size=int(rng.integers(1, 60)))
             for _ in range(int(rng.integers(1, 3)))] for _ in range(n)]


def test_megatron_files_are_read_as_megatron_core_writes_them(tmp_path: Path):
    docs = _docs(300)
    write_megatron(tmp_path / "corpus_text_document", docs)
    info = describe_data(str(tmp_path / "corpus_text_document"))
    assert (info.kind, info.vocab_size) == ("megatron", None)
    assert describe_data(str(tmp_path / "corpus_text_document.bin")).kind == "megatron"
    mf = MegatronFile(str(tmp_path / "corpus_text_document"))
    flat = np.concatenate([s for d in docs for s in d])
    np.testing.assert_array_equal(np.asarray(mf.tokens), flat)
    lengths = [sum(len(s) for s in d) for d in docs]
    np.testing.assert_array_equal(mf.document_offsets, np.concatenate([[0],
                                                                        np.cumsum(lengths)]))
    train, val = open_token_data(info, 16)
    cut = train.split_stop
    assert cut in set(mf.document_offsets.tolist())  # held out by whole documents
    assert cut >= int(len(flat) * (1 - TOKEN_VALIDATION_FRACTION))
    x, y = train.batch([0, 5, len(train) - 1])
    np.testing.assert_array_equal(x[1], flat[5:21])
    np.testing.assert_array_equal(y[1], flat[6:22])
    np.testing.assert_array_equal(val.batch([0])[0][0], flat[cut:cut + 16])
    assert largest_id(train) == int(flat.max())
    first = scan_tokens(mf)
    assert first == scan_tokens(mf)  # the cached scan
    assert np.isfinite(train.unigram_baseline())


def test_megatron_other_dtypes_and_damage(tmp_path: Path):
    write_megatron(tmp_path / "i32", _docs(20, 1), dtype=np.int32)
    assert MegatronFile(str(tmp_path / "i32")).dtype == np.dtype("<i4")
    write_megatron(tmp_path / "f32", _docs(3, 1), dtype=np.float32)
    with pytest.raises(ValueError, match=r"f32\.idx: dtype code 7 is not a token id type"):
        describe_data(str(tmp_path / "f32"))
    write_megatron(tmp_path / "cut", _docs(20, 2))
    size = os.path.getsize(tmp_path / "cut.bin")
    with open(tmp_path / "cut.bin", "r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(ValueError, match=rf"cut\.bin: truncated: {size - 2} bytes, its index "
                                         rf"names {size}"):
        describe_data(str(tmp_path / "cut"))


def test_nanogpt_bins_with_their_val_bin(tmp_path: Path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50257, size=5000)
    vids = rng.integers(0, 50257, size=400)
    write_nanogpt(tmp_path / "train.bin", ids)
    write_nanogpt(tmp_path / "val.bin", vids)
    info = describe_data(str(tmp_path / "train.bin"))
    assert (info.kind, info.vocab_size) == ("nanogpt", None)
    train, val = open_token_data(info, 32)
    assert (train.split_start, train.split_stop) == (0, 5000)
    np.testing.assert_array_equal(np.asarray(val.tokens), vids)
    np.testing.assert_array_equal(train.batch([7])[0][0], ids[7:39])
    assert largest_id(train) == int(ids.max())
    with open(tmp_path / "odd.bin", "wb") as f:
        f.write(b"\x00" * 7)
    with pytest.raises(ValueError, match=r"odd\.bin: 7 bytes is not a whole number of uint16"):
        describe_data(str(tmp_path / "odd.bin"))


def test_window_sampler_draws_with_replacement_from_seed_and_step():
    s = WindowSampler(10, 24, seed=3)
    a = s.global_indices(4)
    assert a.shape == (24,) and a.min() >= 0 and a.max() < 10  # fewer windows than B
    np.testing.assert_array_equal(a, WindowSampler(10, 24, seed=3).global_indices(4))
    assert not np.array_equal(a, s.global_indices(5))
    for n in (1, 2, 3, 4, 5):
        parts = [s.local_indices(4, r, n) for r in range(n)]
        np.testing.assert_array_equal(np.concatenate(parts), a)
    s.step = 7
    state = s.state_dict()
    t = WindowSampler(10, 24, seed=3)
    t.load_state_dict(state)
    np.testing.assert_array_equal(t.next_global(), s.global_indices(7))
    with pytest.raises(ValueError, match="sampler without replacement"):
        t.load_state_dict(GlobalBatchSampler(100, 24).state_dict())


def test_large_epochs_are_permuted_without_a_permutation_array(monkeypatch):
    keys = np.random.SeedSequence([1, 2]).generate_state(6, dtype=np.uint64)
    for n in (1, 2, 3, 7, 1000, 4097):
        assert sorted(feistel_permute(np.arange(n), n, keys).tolist()) == list(range(n))
    import mpidist.data.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "PERMUTATION_LIMIT", 50)
    s = GlobalBatchSampler(101, 24, seed=9, drop_last=False)
    seen = np.concatenate([s.global_indices(k) for k in range(s.steps_per_epoch)])
    assert sorted(seen[:101].tolist()) == list(range(101))  # each sample once per epoch
    for n in (2, 3, 4):
        parts = [s.local_indices(6, r, n) for r in range(n)]
        np.testing.assert_array_equal(np.concatenate(parts), s.global_indices(6))
    np.testing.assert_array_equal(s.permutation(1)[:24], s.global_indices(5))


def test_token_file_splits_and_errors(tmp_path: Path):
    (tmp_path / "a.txt").write_text("".join(TEXTS), encoding="utf-8")
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "a.h5"), "bytes")
    info = describe_data(str(tmp_path / "a.h5"))
    assert (info.kind, info.vocab_size) == ("tokens", 257)
    train, val = open_token_data(info, 8)
    n = len(train.tokens)
    # one document: the split falls at the token of the rule
    assert train.split_stop == val.split_start == int(np.floor(n * 0.99))
    assert train.identity()["hash"].startswith("sha256:")
    assert train.identity()["tokenizer"]["name"] == "bytes"
    with pytest.raises(ValueError, match=r"its validation split has \d+ tokens, too few for a "
                                         r"window of block_size=1000"):
        open_token_data(info, 1000)
    # another tokenizer's file is no validation set
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "b.h5"), "bpe:300")
    with pytest.raises(ValueError, match=r"--val-data .*b\.h5: its tokenizer differs"):
        open_token_data(info, 8, val=describe_data(str(tmp_path / "b.h5")))
    ok_train, ok_val = open_token_data(info, 8, val=info)
    assert (ok_train.split_start, ok_train.split_stop) == (0, n) and len(ok_val) == n - 8


_RSS = """
import sys, numpy as np
from mpidist.data import TextCorpus
def anon():
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon:'):
            return int(line.split()[1]) * 1024
base = anon()
train = TextCorpus(64, path=sys.argv[1])
val = TextCorpus(64, 'validation', path=sys.argv[1])
for step in range(20):
    train.batch(np.arange(step, 32 * 1000, 1000) % len(train))
s = train.sampler(32)
s.global_indices(3)
train.unigram_baseline()
print(anon() - base)
"""


def test_plain_text_takes_constant_memory(tmp_path: Path):
    """The test-sized version of the 1 GiB case: a 96 MiB text costs the same anonymous
    memory (RssAnon: mapped file pages are the page cache's) as a 1 MiB one; reading it
    whole would cost its size several times over."""
    line = ("".join(TEXTS).replace("<|endoftext|>", "") * 2).encode()
    small, big = tmp_path / "small.txt", tmp_path / "big.txt"
    small.write_bytes(line * (1 + (1 << 20) // len(line)))
    with open(big, "wb") as f:
        for _ in range(96):
            f.write(line * (1 + (1 << 20) // len(line)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    grow = []
    for path in (small, big):
        out = subprocess.run([sys.executable, "-c", _RSS, str(path)], env=env, text=True,
                             capture_output=True, timeout=300)
        assert out.returncode == 0, out.stderr
        grow.append(int(out.stdout.strip()))
    assert grow[1] - grow[0] < 16 << 20, grow
