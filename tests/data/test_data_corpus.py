"""TextCorpus: deterministic, disjoint splits, correct windows; synthetic data sets."""

from __future__ import annotations

import numpy as np
import pytest

from mpidist.data import TextCorpus, synthetic_classification, synthetic_regression
from mpidist.data.corpus import STDLIB_FILES


def test_corpus_is_deterministic() -> None:
    a = TextCorpus(32)
    b = TextCorpus(32)
    assert a.fingerprint == b.fingerprint
    assert len(a.fingerprint) == 64
    assert len(a) == len(b) > 1000
    idx = np.array([0, 7, len(a) - 1])
    for u, v in zip(a.batch(idx), b.batch(idx), strict=True):
        np.testing.assert_array_equal(u, v)
    assert a.files == tuple(sorted(a.files))
    assert set(a.files) <= set(STDLIB_FILES)
    assert len(a.files) >= 30
    assert 500_000 < len(a.text) <= 4 * 1024 * 1024
    assert TextCorpus(64, "validation").fingerprint == a.fingerprint


def test_splits_are_disjoint_and_cover_the_tail() -> None:
    bs = 32
    train, val = TextCorpus(bs), TextCorpus(bs, "val")
    assert val.split == "validation"
    assert train.split_stop == val.split_start
    assert 0.08 < len(val.tokens) / len(train.text) < 0.12
    # Every train window ends before the first validation byte.
    assert train.offsets[-1] + bs + 1 <= val.split_start
    assert val.offsets[0] >= val.split_start
    assert val.offsets[-1] + bs + 1 <= len(val.text)
    assert not set(train.offsets.tolist()) & set(val.offsets.tolist())


def test_samples_are_shifted_windows_of_the_text() -> None:
    c = TextCorpus(16)
    x, y = c.batch([3, 5])
    assert x.shape == y.shape == (2, 16)
    assert x.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    raw = np.frombuffer(c.text, dtype=np.uint8)
    np.testing.assert_array_equal(x[0], raw[c.offsets[3] : c.offsets[3] + 16])
    xi, yi = c[5]
    np.testing.assert_array_equal(xi, x[1])
    np.testing.assert_array_equal(yi, y[1])
    assert x.max() < c.vocab_size == 256


def test_unigram_baseline_and_codec() -> None:
    c = TextCorpus(64)
    h = c.unigram_baseline()
    assert 2.0 < h < np.log(256)
    assert h == TextCorpus(8, "validation").unigram_baseline()  # always the train split
    ids = TextCorpus.encode("import os\n")
    assert TextCorpus.decode(ids) == "import os\n"
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        TextCorpus.decode([300])


def test_corpus_bad_input() -> None:
    c = TextCorpus(16)
    with pytest.raises(ValueError, match="split='test'"):
        TextCorpus(16, "test")
    with pytest.raises(ValueError, match="block_size=0"):
        TextCorpus(0)
    with pytest.raises(ValueError, match=f"sample index {len(c)} is out of range"):
        c.batch([len(c)])
    with pytest.raises(ValueError, match="sample index -1"):
        c.batch([-1])
    with pytest.raises(ValueError, match="block_size=10000000 leaves no sample"):
        TextCorpus(10_000_000)


def test_synthetic_sets_are_deterministic_and_batchable() -> None:
    a = synthetic_regression(50, 3, 2, seed=4)
    b = synthetic_regression(50, 3, 2, seed=4)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    assert not np.array_equal(a.x, synthetic_regression(50, 3, 2, seed=5).x)
    x, y = a.batch(np.array([1, 4]), dtype=np.float32)
    assert x.shape == (2, 3) and y.shape == (2, 2) and x.dtype == y.dtype == np.float32
    assert len(a) == 50
    c = synthetic_classification(40, 3, 4, seed=0)
    x, y = c.batch([0, 1, 2])
    assert y.dtype == np.int64 and set(c.y.tolist()) <= {0, 1, 2, 3}
    with pytest.raises(ValueError, match="sample index 40 is out of range for 40"):
        c.batch([40])
    with pytest.raises(ValueError, match="d_in=0"):
        synthetic_regression(5, 0, 1)


def test_text_problem_accepts_any_language_and_names_what_is_wrong() -> None:
    from mpidist.data.corpus import text_problem

    assert text_problem("naïve café — 東京 ✓\n\tdef f():\r\n\f".encode()) is None
    assert text_problem(b"") is None
    assert text_problem(b"abc\xff\xfe") == "not valid UTF-8 at byte 3"
    assert text_problem(b"\x1b[0m" * 8) == "25% control bytes"  # terminal escapes
    assert text_problem(b"\x00" * 10 + b"x" * 90) == "10% control bytes"
    assert text_problem(b"\x00" * 4 + b"x" * 96) is None  # a few control bytes are fine


def test_a_binary_file_is_refused_and_binary_true_takes_it(tmp_path) -> None:
    blob = tmp_path / "model.bin"
    blob.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(ValueError, match=r"data='.*model.bin' is not text \(not valid UTF-8 at "
                                         r"byte 128\); --data-binary \(binary=True\) trains"):
        TextCorpus(8, path=str(blob))
    corpus = TextCorpus(8, path=str(blob), binary=True)
    assert bytes(corpus.text) == blob.read_bytes() and corpus.files == ("model.bin",)


def test_a_directory_skips_and_counts_binary_files(tmp_path) -> None:
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("print('héllo')\n" * 20)
    (tmp_path / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\xa7\r\r\n" + bytes(64))
    (tmp_path / "notes.txt").write_text("plain notes\n" * 20)
    corpus = TextCorpus(8, path=str(tmp_path))
    assert corpus.files == ("notes.txt", "pkg/a.py")
    assert corpus.skipped == ("pkg/__pycache__/a.cpython-311.pyc",)
    assert b"\xa7" not in bytes(corpus.text)
    every = TextCorpus(8, path=str(tmp_path), binary=True)
    assert every.skipped == () and len(every.files) == 3
    only_binary = tmp_path / "pkg" / "__pycache__"
    with pytest.raises(ValueError, match=r"none of its 1 file\(s\) is text"):
        TextCorpus(8, path=str(only_binary))
