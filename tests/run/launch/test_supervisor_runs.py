"""``mpidist run --elastic`` around ``mpidist train``: the supervisor holds the run
directory's lock for the whole run (its launches inherit it), a launch that refuses its
input (exit status 2) is not restarted, and a restart resumes whatever the flags say."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_env import cli_env

MPIEXEC = shutil.which("mpiexec")
pytestmark = [pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH"),
              pytest.mark.timeout(240)]

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--global-batch", "12", "--dtype", "float64", "--eval-interval", "0",
        "--eval-batches", "1", "--no-progress"]
TRAIN = [sys.executable, "-m", "mpidist.cli", "train"]


env = cli_env


def supervisor(out: Path, *train_args: str) -> list[str]:
    return [sys.executable, "-m", "mpidist.cli", "run", "--elastic", "--min-workers", "1",
            "--max-workers", "2", "-n", "2", "--max-restarts", "2", "--launcher", MPIEXEC,
            "--launcher-arg=-q", "--", *TRAIN, "--out", str(out), *train_args]


def events(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]


def test_the_supervisor_holds_the_lock_between_and_during_launches(tmp_path: Path):
    out = tmp_path / "run"
    sup = subprocess.Popen(supervisor(out, "--resume", "auto", "--steps", "100000",
                                      "--checkpoint-interval", "0", *TINY),
                           env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists():
            assert sup.poll() is None and time.monotonic() < deadline, sup.stderr.read()
            time.sleep(0.05)
        lock = json.loads((out / "run.lock").read_text())
        assert lock["holder"] == "mpidist run --elastic" and lock["pid"] == sup.pid
        other = subprocess.run([MPIEXEC, "-q", "-n", "2", *TRAIN, "--out", str(out),
                                "--resume", "auto", *TINY], env=env(), capture_output=True,
                               text=True, timeout=120)
        assert other.returncode == 2
        (line,) = [ln for ln in other.stderr.splitlines() if "error:" in ln]
        assert line.startswith(f"mpidist train: error: --out {out} is in use by mpidist run "
                               f"--elastic (pid {sup.pid} on ")
    finally:
        sup.send_signal(signal.SIGINT)  # Ctrl-C: the supervisor stops its job and returns
        sup.wait(timeout=60)
    assert sup.returncode == 130
    assert not (out / "run.lock").exists()


def test_a_refused_launch_is_not_restarted_and_a_restart_resumes(tmp_path: Path):
    out = tmp_path / "run"
    done = subprocess.run([MPIEXEC, "-q", "-n", "2", *TRAIN, "--out", str(out), "--steps", "2",
                           *TINY], env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    sup = subprocess.run(supervisor(out, "--resume", "--steps", "3", "--dtype", "float32"),
                         env=env(), capture_output=True, text=True, timeout=180)
    assert sup.returncode == 2
    assert f"mpidist train: error: checkpoint {out}/ckpt-00000002.h5 was trained with --dtype " \
           "float64; this run asks for --dtype float32" in sup.stderr
    kinds = [(e["event"], e.get("returncode")) for e in events(out) if e.get("source")]
    assert kinds == [("launch", None), ("crash", 2), ("gave_up", None)]
    # A restart (MPIDIST_RESTART > 0) resumes from the checkpoint even with --overwrite,
    # which applies to the first start only.
    again = subprocess.run([MPIEXEC, "-q", "-n", "2", *TRAIN, "--out", str(out), "--steps",
                            "3", "--overwrite", *TINY], env=env(MPIDIST_RESTART="1"),
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"resuming {out}/ckpt-00000002.h5 at step 2" in again.stdout
    resume = [e for e in events(out) if e["event"] == "resume"]
    assert [(e["step"], e["restart"]) for e in resume] == [(2, 1)]
