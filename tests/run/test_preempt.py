"""Preemption of `mpidist train`: SIGTERM/SIGUSR1 mid-run -> the step finishes, a collective
checkpoint, exit status 75; --resume then gives the losses of the uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from cli_env import wait_for_rows

from mpidist.run.preempt import EXIT_PREEMPTED, Preemption, requeue_slurm_job, requeued_start

MPIEXEC = shutil.which("mpiexec")
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH")

# Enough steps that the run is still going when the signal arrives; tiny steps.
STEPS = 300
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--global-batch", "12", "--dtype", "float64", "--eval-interval", "0",
        "--eval-batches", "1", "--no-progress", "--steps", str(STEPS),
        "--checkpoint-interval", "0", "--keep", "2"]


def _env(tag: str = "", **extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1",
             NUMBA_NUM_THREADS="1", MPIDIST_TEST_TAG=tag, **extra)
    return e


def _cmd(n: int, out: Path, *args: str, rank_env: dict[str, str] | None = None) -> list[str]:
    # Slurm variables go to the ranks only (-x): in mpiexec's own environment they would
    # make Open MPI launch through Slurm.
    exports = [a for k, v in (rank_env or {}).items() for a in ("-x", f"{k}={v}")]
    return [MPIEXEC, "-n", str(n), *exports, sys.executable, "-m", "mpidist.cli", "train",
            "--out", str(out), *TINY, *args]


def _losses(path: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("split") == "train"}


def _events(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]


def _rank_pids(tag: str) -> dict[int, int]:
    """{MPI rank: pid} of the ranks started with MPIDIST_TEST_TAG=tag."""
    found: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0")
                       if b"=" in kv)
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if env.get(b"MPIDIST_TEST_TAG") != tag.encode() or b"mpidist.cli" not in cmd \
                or MPIEXEC.encode() in cmd.split(b"\0")[0]:
            continue
        rank = env.get(b"OMPI_COMM_WORLD_RANK") or env.get(b"PMIX_RANK")
        if rank is not None:
            found[int(rank)] = int(proc.name)
    return found


def _signal_mid_run(out: Path, n: int, sig: int, *args: str, twice: bool = False,
                    rank_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Start a run, wait for its 3rd step, send ``sig`` to every rank (and a second one to
    rank 0 right after, while the checkpoint is being written, when ``twice``)."""
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(_cmd(n, out, *args, rank_env=rank_env), env=_env(tag),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(proc, out / "metrics.jsonl")
    pids = _rank_pids(tag)
    assert len(pids) == n, pids
    for pid in pids.values():
        os.kill(pid, sig)
    if twice:
        time.sleep(0.02)
        try:
            os.kill(pids[0], sig)
        except ProcessLookupError:
            pass
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@needs_mpiexec
@pytest.mark.timeout(400)
def test_sigterm_checkpoints_and_resume_continues_the_trajectory(tmp_path: Path):
    full = tmp_path / "full"
    done = subprocess.run(_cmd(2, full), env=_env(), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    want = _losses(full / "metrics.jsonl")

    part = tmp_path / "part"
    proc = _signal_mid_run(part, 2, signal.SIGTERM, twice=True)
    assert proc.returncode == EXIT_PREEMPTED, proc.stdout + proc.stderr
    assert "WARNING: preempted by SIGTERM (under mpiexec, Ctrl-C reaches the ranks as " \
           "SIGTERM): stopped after step " in proc.stderr
    assert "with a checkpoint; the ranks exit with status 75" in proc.stderr
    got = _losses(part / "metrics.jsonl")
    stopped = max(got)
    assert 3 <= stopped < STEPS, "the signal should arrive mid-run"
    assert sorted(got) == list(range(1, stopped + 1))  # every rank finished the same step
    events = _events(part)
    pre = [e for e in events if e["event"] == "preempted"]
    assert len(pre) == 1 and pre[0]["step"] == stopped and pre[0]["signal"] == "SIGTERM"
    assert pre[0]["exit_status"] == EXIT_PREEMPTED
    assert (part / "latest").read_text().strip() == f"ckpt-{stopped:08d}.h5"
    assert not [p for p in os.listdir(part) if p.endswith(".tmp") or ".tmp" in p]
    inspect = subprocess.run([sys.executable, "-m", "mpidist.cli", "inspect", str(part),
                              "--verify", "--json"], env=_env(), capture_output=True,
                             text=True, timeout=120)
    assert inspect.returncode == 0, inspect.stderr
    info = json.loads(inspect.stdout)
    assert info["step"] == stopped and info["verified"] is True
    np.testing.assert_allclose([got[s] for s in range(1, stopped + 1)],
                               [want[s] for s in range(1, stopped + 1)], rtol=1e-12)

    # Resume on 3 ranks: the rest of the uninterrupted trajectory.
    resumed = subprocess.run(_cmd(3, part, "--resume"), env=_env(), capture_output=True,
                             text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    got = _losses(part / "metrics.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in range(stopped + 1, STEPS + 1)],
                               [want[s] for s in range(stopped + 1, STEPS + 1)], rtol=1e-10)


@needs_mpiexec
@pytest.mark.timeout(300)
def test_sigusr1_with_requeue_calls_scontrol_and_the_requeued_start_resumes(tmp_path: Path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol-calls"
    fake = bin_dir / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "run"
    slurm = {"MPIDIST_SCONTROL": str(fake), "SLURM_JOB_ID": "4242"}
    proc = _signal_mid_run(out, 2, signal.SIGUSR1, "--requeue", rank_env=slurm)
    assert proc.returncode == EXIT_PREEMPTED, proc.stdout + proc.stderr
    assert calls.read_text().split() == ["requeue", "4242"]
    stopped = max(_losses(out / "metrics.jsonl"))
    pre = [e for e in _events(out) if e["event"] == "preempted"][0]
    assert pre["signal"] == "SIGUSR1" and pre["requeue"] == "requeued Slurm job 4242"
    # The requeued job runs the same command; SLURM_RESTART_COUNT > 0 means "resume".
    again = subprocess.run(_cmd(2, out, "--requeue", "--steps", str(stopped + 2),
                                rank_env={**slurm, "SLURM_RESTART_COUNT": "1"}),
                           env=_env(), capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr
    assert [e["event"] for e in _events(out)].count("resume") == 1
    assert max(_losses(out / "metrics.jsonl")) == stopped + 2


def test_preemption_records_signals_and_restores_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    p = Preemption([signal.SIGUSR1])
    p.install()
    try:
        assert p.agreed(None) == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal changes nothing
        time.sleep(0.05)
        assert p.agreed(None) == signal.SIGUSR1 and p.count == 2
    finally:
        p.restore()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_requeue_outside_slurm_says_why(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert "not under Slurm" in requeue_slurm_job() or "not running under Slurm" in \
        requeue_slurm_job()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert requeued_start()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert not requeued_start()
