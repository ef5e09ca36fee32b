"""Errors of `mpidist train` under mpiexec are one line, once: bad input is printed by rank
0 and every rank exits with status 2 (no MPI_Abort); a divergence is one line; a failure of
one rank aborts the job with that rank's line first and its traceback in the run's log;
a preemption names the signal and the ranks exit with the status it prints."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_env import cli_env, wait_for_rows

MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH")

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--global-batch", "12", "--dtype", "float64", "--eval-interval", "0",
        "--eval-batches", "1", "--no-progress"]

# Rank 1 fails on its own while rank 0 goes on into the first step's collectives.
FAULT = """
import sys
from mpi4py import MPI
import mpidist.run.loop as loop
real = loop.make_data
def make_data(cfg, *args):
    if MPI.COMM_WORLD.Get_rank() == 1:
        raise RuntimeError("the disk of rank 1 is gone")
    return real(cfg, *args)
loop.make_data = make_data
from mpidist.cli import main
sys.exit(main(sys.argv[1:]))
"""


env = cli_env


def mpiexec(n: int, *args: str, script: list[str] | None = None, **extra: str
            ) -> subprocess.CompletedProcess:
    cmd = [MPIEXEC, "-q", "-n", str(n), sys.executable,
           *(script or ["-m", "mpidist.cli"]), *args]
    return subprocess.run(cmd, env=env(**extra), capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("args, line", [
    (["--n-embd", "10", "--n-head", "4"],
     "mpidist train: error: n_embd=10 is not divisible by n_head=4"),
    (["--pp", "2"],
     "mpidist train: error: --pp 2 --tp 1 need --strategy hybrid or elastic (got --strategy ddp)"),
])
def test_bad_input_is_one_line_from_rank_0_and_status_2(tmp_path: Path, args, line):
    out = tmp_path / "run"
    proc = mpiexec(3, "train", "--out", str(out), "--steps", "2", *TINY, *args)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [line]  # once, no MPI_Abort banner, no traceback
    assert not out.exists()  # nothing written, not even the directory


def test_a_usage_error_is_printed_once(tmp_path: Path):
    proc = mpiexec(3, "train", "--out", str(tmp_path / "run"), "--dtype", "float16")
    assert proc.returncode == 2
    assert proc.stderr.count("usage: mpidist train") == 1
    assert [ln for ln in proc.stderr.splitlines() if "error:" in ln] == [
        "mpidist train: error: argument --dtype: invalid choice: 'float16' (choose from "
        "'float32', 'float64')"]


def test_divergence_is_one_line(tmp_path: Path):
    out = tmp_path / "run"
    proc = mpiexec(2, "train", "--out", str(out), "--steps", "20", "--lr", "1e6", *TINY)
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("mpidist train: error: loss became nan at step ")
    assert line.endswith("; lower --lr")
    assert not (out / "summary.json").exists()  # a run that failed has no summary
    assert not (out / "run.lock").exists()


def test_a_failure_of_one_rank_aborts_with_its_line_first(tmp_path: Path):
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = mpiexec(2, "train", "--out", str(out), "--steps", "5", *TINY,
                   script=["-c", FAULT], MPIDIST_ERROR_WAIT_S="2")
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 1
    first = proc.stderr.splitlines()[0]
    assert first == (f"[rank 1] mpidist train: error: RuntimeError: the disk of rank 1 is "
                     f"gone; traceback in {out}/train.log; aborting the MPI job (exit code 1)")
    assert "Traceback" not in proc.stderr
    log = (out / "train.log").read_text()
    assert "[rank 1] Traceback (most recent call last):" in log
    assert "[rank 1] RuntimeError: the disk of rank 1 is gone" in log
    # its flight recorder was dumped before the abort, and the doctor names it
    dump = json.loads((out / "hang" / "rank-1.json").read_text())
    assert dump["reason"] == "abort: RuntimeError: the disk of rank 1 is gone"
    doctor = subprocess.run([sys.executable, "-m", "mpidist.cli", "doctor", str(out)],
                            capture_output=True, text=True, timeout=60, env=env())
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert "aborted: rank 1 (" in doctor.stdout
    assert "RuntimeError: the disk of rank 1 is gone" in doctor.stdout


def test_sigusr1_to_mpiexec_preempts_and_mpiexec_returns_75(tmp_path: Path):
    out = tmp_path / "run"
    proc = subprocess.Popen([MPIEXEC, "-q", "-n", "2", sys.executable, "-m", "mpidist.cli",
                             "train", "--out", str(out), "--steps", "100000",
                             "--checkpoint-interval", "0", *TINY],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(proc, out / "metrics.jsonl")
    proc.send_signal(signal.SIGUSR1)  # Open MPI forwards SIGUSR1 to the ranks
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr
    (line,) = [ln for ln in stderr.splitlines() if "preempted" in ln]
    assert line.startswith("WARNING: preempted by SIGUSR1: stopped after step ")
    assert line.endswith("with a checkpoint; the ranks exit with status 75")
    assert not (out / "run.lock").exists()
