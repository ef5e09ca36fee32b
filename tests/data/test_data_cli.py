"""`mpidist train --data` as a user runs it: a corpus that is not text is refused with one
line before anything is written, unless --data-binary; binary files in a directory are
skipped and counted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH")

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8",
        "--global-batch", "4", "--steps", "1", "--eval-batches", "1", "--no-progress",
        "--checkpoint-interval", "0"]


def _env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    return e


def train(n: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mpidist.cli", "train", *args]
    if n:
        cmd = [MPIEXEC, "-q", "-n", str(n), *cmd]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)


@pytest.fixture
def blob(tmp_path: Path) -> Path:
    path = tmp_path / "tool"
    path.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(range(256)) * 4)
    return path


def test_binary_file_is_one_line_and_nothing_is_written(tmp_path: Path, blob: Path):
    out = tmp_path / "run"
    proc = train(2, "--data", str(blob), "--out", str(out), *TINY)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        f"mpidist train: error: data='{blob}' is not text (not valid UTF-8 at byte 135); "
        "--data-binary (binary=True) trains on its bytes anyway")
    assert proc.stdout == ""
    assert not out.exists()


def test_data_binary_trains_on_the_bytes(tmp_path: Path, blob: Path):
    out = tmp_path / "run"
    proc = train(0, "--data", str(blob), "--data-binary", "--out", str(out), *TINY)
    assert proc.returncode == 0, proc.stderr
    assert (out / "metrics.jsonl").exists()


def test_directory_skips_and_counts_binary_files(tmp_path: Path, blob: Path):
    texts = tmp_path / "texts"
    (texts / "__pycache__").mkdir(parents=True)
    (texts / "a.py").write_text("def f(x):\n    return x * 2  # ×2\n" * 30)
    shutil.copy(blob, texts / "__pycache__" / "a.cpython-311.pyc")
    proc = train(2, "--data", str(texts), "--out", str(tmp_path / "run"), *TINY)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count(f"INFO: data {texts}: 1 text file(s) used, 1 skipped as not text "
                             "(e.g. __pycache__/a.cpython-311.pyc)") == 1
    only = tmp_path / "only"
    only.mkdir()
    shutil.copy(blob, only / "x.bin")
    proc = train(0, "--data", str(only), "--out", str(tmp_path / "none"), *TINY)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"mpidist train: error: data='{only}': none of its 1 file(s) is text (e.g. x.bin); "
        "--data-binary (binary=True) trains on its bytes anyway")


def test_an_unknown_train_flag_prints_trains_usage_once(tmp_path: Path):
    proc = train(2, "--out", str(tmp_path / "run"), "--data-binry", *TINY)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("usage: mpidist train [-h]")
    assert lines[-1] == "mpidist train: error: unrecognized arguments: --data-binry"
    assert proc.stderr.count("usage:") == 1 and "--data-binary" in proc.stderr
    assert not (tmp_path / "run").exists()
