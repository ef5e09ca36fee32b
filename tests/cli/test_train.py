"""`mpidist train` and the checkpoint tools, run as a user runs them (mpiexec + CLI)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_env import cli_env, crashed_at

MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH")

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--global-batch", "12", "--dtype", "float64", "--eval-interval", "5",
        "--eval-batches", "1", "--no-progress"]


env = cli_env


def mpidist(n: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mpidist.cli", *args]
    if n:
        cmd = [MPIEXEC, "-n", str(n), *cmd]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=240)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def rows(path: Path, split: str = "train") -> dict[int, float]:
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("split", "train") == split:
            out[r["step"]] = r["loss"]
    return out


def test_train_outputs_and_resume_at_another_world_size(tmp_path: Path):
    full = tmp_path / "full"
    mpidist(2, "train", "--out", str(full), "--steps", "10", "--checkpoint-interval", "5",
            "--keep", "5", *TINY)
    names = sorted(os.listdir(full))
    for want in ("ckpt-00000005.h5", "ckpt-00000010.h5", "events.jsonl", "latest",
                 "loss.png", "metrics.jsonl", "summary.json"):
        assert want in names
    losses = rows(full / "metrics.jsonl")
    assert sorted(losses) == list(range(1, 11))
    assert rows(full / "metrics.jsonl", "validation")
    summary = json.loads((full / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(summary["memory_bytes_per_rank"]) == 2
    events = [json.loads(x)["event"] for x in (full / "events.jsonl").read_text().splitlines()]
    assert events[0] == "start" and events[-1] == "end" and "checkpoint" in events

    # A crash after step 5: only the first checkpoint survives. Resume on 3 ranks.
    part = crashed_at(full, 5, tmp_path / "part")
    mpidist(3, "train", "--out", str(part), "--steps", "10", "--resume", *TINY)
    resumed = rows(part / "metrics.jsonl")
    assert sorted(resumed) == list(range(6, 11))
    np.testing.assert_allclose([resumed[s] for s in range(6, 11)],
                               [losses[s] for s in range(6, 11)], rtol=1e-9)
    kinds = [json.loads(x)["event"] for x in (part / "events.jsonl").read_text().splitlines()]
    assert kinds[0] == "resume"

    # The tools on the result.
    out = mpidist(0, "inspect", str(part / "ckpt-00000010.h5"), "--verify").stdout
    assert "params/final.head.weight" in out or "final.head.weight" in out
    info = json.loads(mpidist(0, "inspect", str(part), "--json").stdout)
    assert info  # a JSON report of the latest checkpoint
    # the resumed run's weights are the uninterrupted run's (exit status 1 if they differ)
    d = mpidist(0, "diff", str(full / "ckpt-00000010.h5"), str(part / "ckpt-00000010.h5"),
                "--json", "--atol", "1e-9").stdout
    assert json.loads(d)["differ"] == {}
    npz = tmp_path / "model.npz"
    mpidist(0, "export", str(part / "ckpt-00000010.h5"), "--to", str(npz))
    with np.load(npz) as z:
        assert "final.head.weight" in z.files
    text = mpidist(0, "sample", str(part), "--prompt", "import ", "--tokens", "20").stdout
    assert text.startswith("import ") and len(text.encode()) >= len("import ") + 20


def test_toml_config_and_flags_override(tmp_path: Path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[train]\nsteps = 3\nstrategy = "zero3"\ncheckpoint-interval = 0\n')
    out = tmp_path / "run"
    mpidist(2, "train", "--config", str(cfg), "--out", str(out), "--steps", "4", *TINY)
    assert sorted(rows(out / "metrics.jsonl")) == [1, 2, 3, 4]
    assert json.loads((out / "summary.json").read_text())["strategy"] == "zero3"


@pytest.mark.parametrize("args, message", [
    (["--n-embd", "10", "--n-head", "4"], "n_embd=10 is not divisible by n_head=4"),
    (["--global-batch", "1"], "--global-batch 1 is too small for 2 data-parallel ranks"),
    (["--pp", "2"], "--pp 2 --tp 1 need --strategy hybrid"),
    (["--virtual-stages", "2"], "--virtual-stages 2 needs --schedule interleaved (got "
                                "--schedule 1f1b)"),
    (["--strategy", "hybrid", "--pp", "2", "--schedule", "interleaved", "--virtual-stages",
      "2", "--micro-batches", "3"], "schedule='interleaved' needs micro_batches a multiple "
                                    "of pp=2; got micro_batches=3"),
    (["--strategy", "hybrid", "--pp", "2", "--schedule", "interleaved", "--virtual-stages",
      "2", "--micro-batches", "2"], "virtual_stages=2 with pp=2 needs at least 4 units"),
])
def test_bad_flags_fail_on_every_rank(tmp_path: Path, args, message):
    base = [a for a in TINY if a not in ("--global-batch", "12")]
    proc = mpidist(2, "train", "--out", str(tmp_path), "--steps", "2", *base, *args, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_hybrid_run_resumes_as_another_strategy(tmp_path: Path):
    """A (pp=2, tp=2) checkpoint holds global tensors: ZeRO-2 on 3 ranks continues it."""
    args = [*TINY, "--n-layer", "2", "--steps", "4", "--checkpoint-interval", "2", "--keep", "5"]
    hybrid = tmp_path / "hybrid"
    mpidist(4, "train", "--out", str(hybrid), "--strategy", "hybrid", "--pp", "2", "--tp", "2",
            "--micro-batches", "2", *args)
    ddp = tmp_path / "ddp"
    mpidist(2, "train", "--out", str(ddp), *args)
    want = rows(ddp / "metrics.jsonl")
    np.testing.assert_allclose([rows(hybrid / "metrics.jsonl")[s] for s in range(1, 5)],
                               [want[s] for s in range(1, 5)], rtol=1e-9)
    part = crashed_at(hybrid, 2, tmp_path / "part")
    mpidist(3, "train", "--out", str(part), "--strategy", "zero2", "--resume", *args)
    got = rows(part / "metrics.jsonl")
    np.testing.assert_allclose([got[3], got[4]], [want[3], want[4]], rtol=1e-9)


def test_interleaved_run_trains_as_ddp(tmp_path: Path):
    """--schedule interleaved --virtual-stages 2 at pp=2 (4 units: 2 chunks a stage) gives
    DDP's losses; the TOML key is virtual_stages."""
    args = [*TINY, "--n-layer", "2", "--steps", "3", "--checkpoint-interval", "0",
            "--micro-batches", "2"]
    cfg = tmp_path / "run.toml"
    cfg.write_text('[train]\nschedule = "interleaved"\nvirtual-stages = 2\n')
    inter = tmp_path / "interleaved"
    mpidist(2, "train", "--config", str(cfg), "--out", str(inter), "--strategy", "hybrid",
            "--pp", "2", *args)
    ddp = tmp_path / "ddp"
    mpidist(2, "train", "--out", str(ddp), *args)
    want, got = rows(ddp / "metrics.jsonl"), rows(inter / "metrics.jsonl")
    np.testing.assert_allclose([got[s] for s in (1, 2, 3)], [want[s] for s in (1, 2, 3)],
                               rtol=1e-9)
