"""`mpidist train --checkpoint-async` under mpiexec: kill -9 of one rank and of every rank
while a write is stopped at each writer-hook point, then a resume at another world size
continues the uninterrupted trajectory (float64); SIGTERM during a write; a write failure;
saves closer together than a write takes; and the asynchronous file equal to the blocking
one.

A killed rank ends the job under Open MPI 4.1 (Debian's mpiexec), so recovery is the
restart path: ``--resume`` from ``latest``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from cli_env import cli_env

from mpidist.checkpoint import latest_checkpoint, read_metadata, verify_checkpoint
from mpidist.checkpoint.writer import HOOK_ENV, WRITER_POINTS
from mpidist.run.preempt import EXIT_PREEMPTED

MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH")

STEPS = 20
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--global-batch", "12", "--dtype", "float64", "--eval-interval", "0",
        "--eval-batches", "1", "--no-progress", "--steps", str(STEPS),
        "--checkpoint-interval", "5", "--keep", "10"]


def _cmd(n: int, out: Path, *args: str) -> list[str]:
    return [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpidist.cli", "train",
            "--out", str(out), *TINY, *args]


def _run(n: int, out: Path, *args: str, hook: str = "", timeout: float = 240
         ) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(n, out, *args), env=cli_env(**{HOOK_ENV: hook}),
                          capture_output=True, text=True, timeout=timeout)


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("split") == "train"}


def _events(out: Path, kind: str = "checkpoint") -> list[dict]:
    rows = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == kind]


def _contents(path: Path) -> dict[str, tuple[bytes, int, int]]:
    with h5py.File(path) as f:
        out = {}
        f.visititems(lambda n, o: out.__setitem__(n, (o[()].tobytes(),
                                                      int(o.attrs["checksum_s1"]),
                                                      int(o.attrs["checksum_s2"])))
                     if isinstance(o, h5py.Dataset) else None)
        return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """The uninterrupted run, blocking saves, 2 ranks."""
    out = tmp_path_factory.mktemp("reference") / "run"
    done = _run(2, out)
    assert done.returncode == 0, done.stderr
    return out, _losses(out)


def _same_trajectory(out: Path, want: dict[int, float]) -> None:
    got = _losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(got)],
                               rtol=1e-12, atol=0)


class _Started:
    """A run under mpiexec whose stderr is read as it comes."""

    def __init__(self, out: Path, hook: str, *args: str) -> None:
        self.proc = subprocess.Popen(_cmd(2, out, "--checkpoint-async", *args),
                                     env=cli_env(**{HOOK_ENV: hook}),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def marked_pids(self, count: int, timeout: float = 120) -> list[int]:
        """The pids of the first ``count`` ranks whose writer reached the hook."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            marks = [ln for ln in self.lines if "checkpoint writer hook: rank" in ln]
            if len(marks) >= count:
                return [int(ln.split("(pid ")[1].split(")")[0]) for ln in marks[:count]]
            assert self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.01)
        raise AssertionError("the writer hook was not reached:\n" + "".join(self.lines))

    def finish(self, timeout: float = 120) -> str:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise
        self.reader.join(10)
        return "".join(self.lines)


# make test: one rank killed mid-write and every rank before the commit (the rest: make
# test-slow)
_IN_MAKE_TEST = {("mid-write", "one"), ("before-commit", "all")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("point", "victims"), [
    pytest.param(p, v, marks=() if (p, v) in _IN_MAKE_TEST else pytest.mark.slow)
    for p in WRITER_POINTS for v in ("one", "all")])
def test_kill_during_a_write_then_resume_elsewhere(tmp_path, reference, point, victims):
    out = tmp_path / "run"
    # The save of step 10 stops at the point (on rank 1 alone, or on every rank).
    who = ",rank=1" if victims == "one" else ""
    run = _Started(out, f"point={point},action=stop,step=10{who}")
    pids = run.marked_pids(1 if victims == "one" else 2)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    log = run.finish()
    assert run.proc.returncode != 0, log
    # The previous checkpoint is `latest`; step 10's exists only as a hidden temp file.
    latest = latest_checkpoint(out)
    assert latest is not None and latest.endswith("ckpt-00000005.h5"), log
    verify_checkpoint(latest)
    assert read_metadata(latest)[0]["step"] == 5
    assert not (out / "ckpt-00000010.h5").exists()
    visible = [n for n in os.listdir(out) if n.endswith(".h5") and not n.startswith(".")]
    assert visible == ["ckpt-00000005.h5"]
    # Resume at another world size: the uninterrupted trajectory.
    resumed = _run(3, out, "--resume", "--checkpoint-async")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stdout and "at step 5 on 3 rank(s)" in resumed.stdout
    _same_trajectory(out, reference[1])
    assert not [n for n in os.listdir(out) if n.startswith(".")]  # the temp file went
    assert (out / "latest").read_text().strip() == f"ckpt-{STEPS:08d}.h5"


@pytest.mark.timeout(400)
def test_sigterm_during_a_write_waits_then_checkpoints(tmp_path, reference):
    out = tmp_path / "run"
    run = _Started(out, "point=mid-write,action=delay,seconds=2,step=10")
    run.marked_pids(2)
    pids = [int(ln.split("(pid ")[1].split(")")[0]) for ln in run.lines
            if "checkpoint writer hook" in ln]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    log = run.finish()
    assert run.proc.returncode == EXIT_PREEMPTED, log
    stopped = max(_losses(out))
    assert 10 < stopped <= 15  # the save of step 15 would have waited for step 10's
    saves = {e["step"]: e for e in _events(out)}
    assert saves[10]["asynchronous"] and saves[10]["commit_step"] == stopped, saves
    if stopped % 5:  # the preemption's own checkpoint, blocking
        assert saves[stopped]["reason"] == "preempted" and not saves[stopped]["asynchronous"]
    else:  # the step's periodic save, in flight when the ranks agreed: waited for
        assert saves[stopped]["asynchronous"] and saves[stopped]["commit_step"] == stopped
    assert (out / "latest").read_text().strip() == f"ckpt-{stopped:08d}.h5"
    for step in (5, 10, stopped):
        verify_checkpoint(out / f"ckpt-{step:08d}.h5")
    inspect = subprocess.run([sys.executable, "-m", "mpidist.cli", "inspect", str(out),
                              "--verify", "--json"], env=cli_env(), capture_output=True,
                             text=True, timeout=120)
    assert inspect.returncode == 0 and json.loads(inspect.stdout)["verified"] is True
    resumed = _run(3, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    _same_trajectory(out, reference[1])


@pytest.mark.timeout(400)
def test_a_write_failure_is_the_blocking_saves_error_on_every_rank(tmp_path):
    hook = "point=mid-write,action=fail,rank=1,step=10"
    blocking = _run(2, tmp_path / "blocking", hook=hook)
    background = _run(2, tmp_path / "async", "--checkpoint-async", hook=hook)
    line = ("mpidist train: error: [rank 1] OSError: [Errno 28] No space left on device "
            "(injected by MPIDIST_CHECKPOINT_WRITER_HOOK at mid-write)")
    for done in (blocking, background):
        assert done.returncode == 2, done.stderr
        # One line, once: every rank raised the same error (no abort of the job).
        assert done.stderr.count(line) == 1, done.stderr
        assert "MPI_ABORT" not in done.stderr
    out = tmp_path / "async"
    last = max(_losses(out))
    assert last >= 10
    assert latest_checkpoint(out).endswith("ckpt-00000005.h5")
    verify_checkpoint(out / "ckpt-00000005.h5")
    assert sorted(n for n in os.listdir(out) if n.endswith(".h5") or n.startswith(".")) \
        == ["ckpt-00000005.h5"]  # no temp file
    failed = _events(out, "checkpoint_failed")
    assert len(failed) == 1 and failed[0]["step"] == 10 and "[rank 1] OSError" \
        in failed[0]["error"]
    assert failed[0]["at_step"] == last  # raised at the boundary after the last step


@pytest.mark.timeout(400)
def test_saves_closer_together_than_a_write_takes(tmp_path, reference):
    out = tmp_path / "run"
    done = _run(2, out, "--checkpoint-async", "--checkpoint-interval", "1",
                hook="point=mid-write,action=delay,seconds=0.25")
    assert done.returncode == 0, done.stderr
    _same_trajectory(out, reference[1])
    saves = _events(out)
    assert [e["step"] for e in saves] == list(range(1, STEPS + 1))  # every one, in order
    for e in saves[:-1]:
        assert e["asynchronous"] and e["commit_step"] == e["step"] + 1, e  # the next waited
        assert e["background_seconds"] >= 0.25 and e["bytes"] > 0
    assert not saves[-1]["asynchronous"]  # the run's last checkpoint is written blocking
    kept = sorted(n for n in os.listdir(out) if n.endswith(".h5"))
    assert kept == [f"ckpt-{s:08d}.h5" for s in range(STEPS - 9, STEPS + 1)]  # --keep 10
    # The asynchronous file is the blocking one, tensor data and checksums.
    ref_out = reference[0]
    for step in (15, 20):
        assert _contents(out / f"ckpt-{step:08d}.h5") == \
            _contents(ref_out / f"ckpt-{step:08d}.h5")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["io_seconds"]["background"] >= 0.25 * (STEPS - 1)
    assert summary["io_seconds"]["blocking"] == summary["time_split_seconds"]["io"]
    assert all(m["host_snapshot"] > 0 for m in summary["memory_bytes_per_rank"])
