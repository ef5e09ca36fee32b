"""`mpidist train` at world sizes that do not divide the global batch, run as a user runs it:
the losses are the single-process ones (float64), and a run checkpointed on 4 ranks resumes
on 3 (the README's "any world size")."""

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
        "--global-batch", "32", "--dtype", "float64", "--eval-interval", "3",
        "--eval-batches", "1", "--no-progress", "--steps", "4", "--optimizer", "adamw"]


def _env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
             OPENBLAS_NUM_THREADS="1")
    return e


def train(n: int, out: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "mpidist.cli", "train", "--out", str(out), *TINY, *args]
    if n:
        cmd = [MPIEXEC, "--oversubscribe", "-n", str(n), *cmd]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def losses(out: Path, split: str = "train") -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("split", "train") == split}


_SINGLE: dict[str, Path] = {}


def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if "out" not in _SINGLE:
        out = tmp_path_factory.mktemp("single") / "run"
        train(0, out, "--checkpoint-interval", "0")
        _SINGLE["out"] = out
    return _SINGLE["out"]


@pytest.mark.parametrize("n, flags", [
    (3, ["--strategy", "ddp", "--micro-batches", "3"]),  # 11+11+10, then 4+4+3 / 4+3+3
    (5, ["--strategy", "zero3"]),  # 7+7+6+6+6
])
def test_uneven_world_matches_one_process(tmp_path: Path, tmp_path_factory, n, flags):
    ref = single(tmp_path_factory)
    train(n, tmp_path / "run", "--checkpoint-interval", "0", *flags)
    for split in ("train", "validation"):
        want, got = losses(ref, split), losses(tmp_path / "run", split)
        assert sorted(got) == sorted(want) and want
        np.testing.assert_allclose([got[s] for s in sorted(got)],
                                   [want[s] for s in sorted(want)], rtol=1e-10)


def test_checkpoint_from_4_ranks_resumes_on_3(tmp_path: Path, tmp_path_factory):
    ref = losses(single(tmp_path_factory))
    full = tmp_path / "z1"
    train(4, full, "--strategy", "zero1", "--checkpoint-interval", "2", "--keep", "2")
    part = crashed_at(full, 2, tmp_path / "part")
    train(3, part, "--strategy", "zero1", "--checkpoint-interval", "2", "--resume")
    got = {**losses(full), **{s: v for s, v in losses(part).items() if s > 2}}
    assert sorted(got) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in range(1, 5)], [ref[s] for s in range(1, 5)],
                               rtol=1e-10)
