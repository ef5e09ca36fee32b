"""Every strategy from `mpidist train`, with its own state in the checkpoints: a run resumed
from a mid-run checkpoint gives the float64 losses of the uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_env import crashed_at

MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH")

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--global-batch", "12", "--dtype", "float64", "--eval-interval", "0",
        "--eval-batches", "1", "--no-progress", "--steps", "6", "--checkpoint-interval", "3",
        "--keep", "5", "--optimizer", "adamw"]


def _env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    return e


def train(n: int, out: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpidist.cli", "train", "--out",
           str(out), *TINY, *args]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("split") == "train"}


def from_step3(tmp_path: Path, full: Path, name: str) -> Path:
    return crashed_at(full, 3, tmp_path / name)


@pytest.mark.parametrize("flags, other_size", [
    # checkpoint at step 3, between two averages: every replica differs
    (["--strategy", "localsgd", "--sync-period", "2"], None),
    # PowerSGD: per-rank residuals (as top-k) and the warm-start factors
    (["--strategy", "compressed", "--compression", "powersgd", "--powersgd-rank", "1"], None),
    (["--strategy", "async", "--staleness", "2"], 3),
    (["--strategy", "hybrid", "--zero-stage", "3", "--micro-batches", "2"], None),
], ids=["localsgd", "powersgd", "async", "hybrid-zero3"])
def test_strategy_resumes_exactly(tmp_path: Path, flags: list[str], other_size: int | None):
    full = tmp_path / "full"
    train(2, full, *flags)
    want = losses(full)
    assert sorted(want) == list(range(1, 7))
    summary = json.loads((full / "summary.json").read_text())
    assert summary["strategy"] == flags[1]
    part = from_step3(tmp_path, full, "part")
    train(2, part, *flags, "--resume")
    got = losses(part)
    np.testing.assert_allclose([got[s] for s in (4, 5, 6)], [want[s] for s in (4, 5, 6)],
                               rtol=1e-12, atol=0)
    other = from_step3(tmp_path, full, "other")
    if other_size:  # state that is the same on every rank resumes at another size
        train(other_size, other, *flags, "--resume")
        got = losses(other)
        np.testing.assert_allclose([got[s] for s in (4, 5, 6)],
                                   [want[s] for s in (4, 5, 6)], rtol=1e-10)
    elif flags[1] == "localsgd":  # per-rank replicas: a clear error at another size
        proc = train(3, other, *flags, "--resume", check=False)
        assert proc.returncode != 0
        assert "per-rank local_sgd state of 2 data-parallel ranks" in proc.stderr


def test_data_flag_trains_on_a_directory_of_text(tmp_path: Path):
    data = tmp_path / "texts"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    (data / "sub" / "b.txt").write_text("pack my box with five dozen liquor jugs\n" * 40)
    out = tmp_path / "run"
    train(2, out, "--data", str(data))
    assert sorted(losses(out)) == list(range(1, 7))
    # The same data and flags on one rank: the same losses (world-size invariance).
    one = tmp_path / "one"
    proc = subprocess.run([sys.executable, "-m", "mpidist.cli", "train", "--out", str(one),
                           *TINY, "--data", str(data)], env=_env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(list(losses(one).values()), list(losses(out).values()),
                               rtol=1e-10)
