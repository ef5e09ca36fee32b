"""Checkpoints written by an earlier mpidist (tests/checkpoint/fixtures/, one per strategy,
from ``mpidist train``; see make_fixtures.py there) still verify with today's reader, and
resumed on the same 2 ranks with the same flags they train on exactly as they did when
they were written: the losses of steps 3 and 4, the validation loss and a few parameters
of expected.json, to 1e-10 relative.

Never regenerate the fixtures to make this test pass: a difference means the checkpoint
format or the training a checkpoint continues has changed for existing runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_env import cli_env

from mpidist.checkpoint import FORMAT_NAME, inspect, read_tensor, verify_checkpoint

FIXTURES = Path(__file__).resolve().parent / "fixtures"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
NAMES = list(EXPECTED["fixtures"])
MPIEXEC = shutil.which("mpiexec")
RTOL = 1e-10


def test_every_strategy_has_a_fixture():
    assert set(NAMES) == {"ddp", "zero1", "zero2", "zero3", "hybrid-pp2", "hybrid-tp2",
                          "localsgd", "compressed", "async"}
    for name in NAMES:
        assert (FIXTURES / EXPECTED["fixtures"][name]["file"]).is_file(), name


@pytest.mark.parametrize("name", NAMES)
def test_fixture_verifies(name: str):
    fx = EXPECTED["fixtures"][name]
    path = FIXTURES / fx["file"]
    report = verify_checkpoint(path)
    assert report["ok"] is True
    info = inspect(path, verify=True)
    assert info["verified"] is True
    assert info["format"] == FORMAT_NAME
    assert info["world_size"] == fx["ranks"]
    assert info["attrs"]["steps_taken"] == fx["fixture_step"]
    assert info["attrs"]["data"]["step"] == fx["fixture_step"]
    assert info["attrs"]["extra"]["train_config"]["strategy"] == fx["flags"][1]
    params = [n for n in info["tensors"] if n.startswith("params/")]
    assert len(params) == 29, params  # the tiny GPT's 2 blocks, embeddings and head
    for n in params:  # every parameter reads back whole, finite, checksum-verified
        t = read_tensor(path, n)
        assert list(t.shape) == info["tensors"][n]["shape"]
        assert np.isfinite(t).all(), n


def _losses(out: Path) -> tuple[dict[int, float], dict[int, float]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r["loss"] for r in rows if r.get("split") == "train"}
    val = {r["step"]: r["loss"] for r in rows if r.get("split") == "validation"}
    return train, val


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH")
@pytest.mark.parametrize("name", NAMES)
def test_fixture_resumes_as_it_did(tmp_path: Path, name: str):
    fx = EXPECTED["fixtures"][name]
    run = tmp_path / "run"
    run.mkdir()
    ckpt = f"ckpt-{fx['fixture_step']:08d}.h5"
    shutil.copy(FIXTURES / fx["file"], run / ckpt)
    (run / "latest").write_text(ckpt + "\n")
    cmd = [MPIEXEC, "-n", str(fx["ranks"]), sys.executable, "-m", "mpidist.cli", "train",
           "--out", str(run), *EXPECTED["common_flags"], *fx["flags"],
           "--steps", str(fx["resume_steps"]), "--resume"]
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    train, val = _losses(run)
    want = {int(s): v for s, v in fx["losses"].items()}
    assert sorted(train) == sorted(want), train
    np.testing.assert_allclose([train[s] for s in sorted(want)],
                               [want[s] for s in sorted(want)], rtol=RTOL, atol=0)
    np.testing.assert_allclose(val[fx["resume_steps"]], fx["validation_loss"], rtol=RTOL,
                               atol=0)
    end = run / f"ckpt-{fx['resume_steps']:08d}.h5"
    for pname, w in fx["params"].items():
        t = np.asarray(read_tensor(end, pname), dtype=np.float64).ravel()
        np.testing.assert_allclose(t[:len(w["first"])], w["first"], rtol=RTOL, atol=1e-14,
                                   err_msg=pname)
        np.testing.assert_allclose(t.sum(), w["sum"], rtol=RTOL, atol=1e-12, err_msg=pname)
