"""A run directory belongs to one run, and --resume continues it with its own settings:
`mpidist train` under mpiexec, as a user runs it. Each case checks the exit status, the
one line printed and the files left behind (byte for byte where nothing may change)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cli_env import cli_env

MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH")

MODEL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
         "--global-batch", "12", "--dtype", "float64"]
QUIET = ["--eval-interval", "0", "--eval-batches", "1", "--no-progress"]


env = cli_env


def train(n: int, out: Path, *args: str, rc: int = 0, **extra: str
          ) -> subprocess.CompletedProcess:
    """``mpiexec -q -n N mpidist train --out OUT ARGS``; asserts the exit status."""
    cmd = [sys.executable, "-m", "mpidist.cli", "train", "--out", str(out), *args]
    if n:
        cmd = [MPIEXEC, "-q", "-n", str(n), *cmd]
    proc = subprocess.run(cmd, env=env(**extra), capture_output=True, text=True, timeout=240)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    return proc


def snapshot(d: Path) -> dict[str, str]:
    """Every file under ``d`` with the checksum of its bytes."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def rows(path: Path, split: str = "train") -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines())
            if r.get("split", "train") == split]


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "error:" in ln]


@pytest.fixture(scope="module")
def z1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A zero1 float64 run of 6 steps on 2 ranks, checkpoints at 3 and 6 (the reference)."""
    out = tmp_path_factory.mktemp("z1") / "z1"
    train(2, out, "--strategy", "zero1", "--steps", "6", "--checkpoint-interval", "3",
          "--keep", "5", "--lr", "0.01", "--warmup-steps", "2", *MODEL, *QUIET)
    return out


def cut_at_3(z1: Path, dest: Path) -> Path:
    """``z1`` as if the run had been killed after its step-3 checkpoint, then rerun to 6."""
    shutil.copytree(z1, dest)
    (dest / "ckpt-00000006.h5").unlink()
    (dest / "latest").write_text("ckpt-00000003.h5\n")
    return dest


def test_resume_takes_the_settings_from_the_checkpoint(z1: Path, tmp_path: Path):
    run = cut_at_3(z1, tmp_path / "run")
    # Only what changes: the world size. Strategy, dtype, model, lr, schedule, batch,
    # seed come from the checkpoint; the rows of the abandoned steps 4-6 are dropped.
    proc = train(3, run, "--resume", "--no-progress")
    assert f"resuming {run}/ckpt-00000003.h5 at step 3 on 3 rank(s); learning rate at " \
           "step 4: 0.008" in proc.stdout
    assert "zero1 on 3 rank(s)" in proc.stdout and "float64" in proc.stdout
    got, want = rows(run / "metrics.jsonl"), rows(z1 / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-9)
    assert [r["lr"] for r in got] == pytest.approx([r["lr"] for r in want], rel=1e-12)
    events = rows(run / "events.jsonl")
    steps = [(e["event"], e["step"]) for e in events]
    assert steps == [("start", 0), ("checkpoint", 3), ("resume", 3), ("start", 3),
                     ("checkpoint", 6), ("end", 6)]
    for e in events:  # an attempt's first event says why in-job recovery is off here
        if e["event"] in ("start", "resume"):
            assert e["fault_tolerance"].startswith("off: Open MPI v4"), e
            assert e["recovery"] == f"in-job recovery {e['fault_tolerance']}", e
    assert json.loads((run / "summary.json").read_text())["steps_this_run"] == 3


def test_a_contradicting_flag_is_one_line_and_changes_nothing(z1: Path, tmp_path: Path):
    run = cut_at_3(z1, tmp_path / "run")
    before = snapshot(run)
    proc = train(2, run, "--resume", "--dtype", "float32", "--n-embd", "32", rc=2)
    want = (f"mpidist train: error: checkpoint {run}/ckpt-00000003.h5 was trained with "
            "--dtype float64 --n-embd 16; this run asks for --dtype float32 --n-embd 32")
    assert error_lines(proc.stderr) == [want]
    assert "MPI_ABORT" not in proc.stderr and "Traceback" not in proc.stderr
    assert snapshot(run) == before


def test_nothing_to_do_changes_no_file(z1: Path, tmp_path: Path):
    run = tmp_path / "run"
    shutil.copytree(z1, run)
    before = snapshot(run)
    for steps in ([], ["--steps", "6"], ["--steps", "4"]):
        proc = train(2, run, "--resume", *steps)
        assert proc.stdout.strip() == (f"mpidist train: ckpt-00000006.h5 in {run} is at step "
                                       f"6 and --steps is {steps[-1] if steps else 6}: "
                                       "nothing to do (give a larger --steps to train "
                                       "further)")
        assert snapshot(run) == before


def test_a_larger_steps_extends_the_run_at_the_end_of_the_schedule(z1: Path, tmp_path: Path):
    run = tmp_path / "run"
    shutil.copytree(z1, run)
    proc = train(2, run, "--resume", "--steps", "8")
    # The schedule decayed to --min-lr at step 6 (the run's first --steps); it stays there.
    lrs = {r["step"]: r["lr"] for r in rows(run / "metrics.jsonl")}
    assert lrs[7] == lrs[8] == pytest.approx(3e-4)
    assert "learning rate at step 7: 0.0003 (cosine to --min-lr 0.0003 at step 6)" in \
        proc.stdout
    # --lr-decay-steps moves the horizon (and says that it differs from the checkpoint's).
    again = tmp_path / "again"
    shutil.copytree(z1, again)
    proc = train(2, again, "--resume", "--steps", "8", "--lr-decay-steps", "10")
    assert "using --lr-decay-steps 10 (the checkpoint was trained with --lr-decay-steps 6)" \
        in proc.stdout
    assert rows(again / "metrics.jsonl")[6]["lr"] > 3e-4


def test_resume_without_a_checkpoint_is_an_error_and_auto_starts(tmp_path: Path):
    missing = tmp_path / "z11"
    proc = train(2, missing, "--resume", *MODEL, rc=2)
    assert error_lines(proc.stderr) == [
        f"mpidist train: error: --resume: --out {missing} does not exist; give the directory "
        "of the run to continue, or --resume auto to start when there is none"]
    assert not missing.exists()
    toml = tmp_path / "run.toml"
    toml.write_text('resume = "auto"\nsteps = 2\ncheckpoint-interval = 0\n')
    train(2, missing, "--config", str(toml), *MODEL, *QUIET)
    assert [r["step"] for r in rows(missing / "metrics.jsonl")] == [1, 2]
    proc = train(2, missing, "--config", str(toml), "--steps", "3", *MODEL, *QUIET)
    assert "resuming" in proc.stdout
    assert [r["step"] for r in rows(missing / "metrics.jsonl")] == [1, 2, 3]


def test_a_new_run_never_overwrites_another_silently(z1: Path, tmp_path: Path):
    run = tmp_path / "run"
    shutil.copytree(z1, run)
    before = snapshot(run)
    proc = train(2, run, "--steps", "2", *MODEL, rc=2)
    assert error_lines(proc.stderr) == [
        f"mpidist train: error: --out {run} holds 2 checkpoints of a run (latest "
        "ckpt-00000006.h5, step 6); continue it with --resume, or start over with "
        "--overwrite (deletes that run's files)"]
    assert snapshot(run) == before
    proc = train(2, run, "--steps", "2", "--overwrite", "--checkpoint-interval", "0",
                 *MODEL, *QUIET)
    assert "--overwrite: deleted ckpt-00000003.h5, ckpt-00000006.h5, latest, metrics.jsonl" \
           in proc.stdout
    assert sorted(os.listdir(run)) == ["ckpt-00000002.h5", "events.jsonl", "latest",
                                       "loss.png", "metrics.jsonl", "summary.json"]
    assert [e["event"] for e in rows(run / "events.jsonl")] == ["start", "checkpoint", "end"]


def test_overwrite_deletes_an_earlier_runs_flight_recorder_dumps(tmp_path: Path):
    from mpidist.run.directory import remove_run_outputs

    hang = tmp_path / "hang"
    hang.mkdir()
    for name in ("rank-0.json", "rank-0.stacks.txt", "spawned-77.json"):
        (hang / name).write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert remove_run_outputs(str(tmp_path)) == ["metrics.jsonl", "hang/"]
    assert os.listdir(tmp_path) == []
    hang.mkdir()
    (hang / "notes.txt").write_text("the user's own")  # not a dump: kept, with the folder
    assert remove_run_outputs(str(tmp_path)) == []
    assert os.listdir(hang) == ["notes.txt"]


def _rank_pids(tag: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes()
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"MPIDIST_TEST_TAG={tag}".encode() in environ.split(b"\0") \
                and b"mpidist.cli" in cmd and not cmd.startswith(MPIEXEC.encode()):
            found.append(int(proc.name))
    return found


def test_one_run_per_directory_and_a_killed_runs_lock_is_stale(tmp_path: Path):
    run = tmp_path / "run"
    tag = f"lock-{os.getpid()}-{time.monotonic_ns()}"
    first = subprocess.Popen([MPIEXEC, "-q", "-n", "2", sys.executable, "-m", "mpidist.cli",
                              "train", "--out", str(run), "--steps", "100000",
                              # no straggler reports: the second run slows this one's
                              # ranks unevenly, and a named straggler's warning would
                              # create train.log while the test checks nothing is added
                              "--checkpoint-interval", "0", "--straggler-interval", "0",
                              *MODEL, *QUIET],
                             env=env(MPIDIST_TEST_TAG=tag), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        holder = json.loads((run / "run.lock").read_text())
        before = snapshot(run)
        t0 = time.monotonic()
        proc = train(2, run, "--resume", "auto", *MODEL, rc=2)
        assert time.monotonic() - t0 < 60
        (line,) = error_lines(proc.stderr)
        assert line.startswith(f"mpidist train: error: --out {run} is in use by mpidist train "
                               f"rank 0 (pid {holder['pid']} on {holder['host']}, renewed ")
        assert set(snapshot(run)) == set(before)  # nothing added
        assert json.loads((run / "run.lock").read_text())["token"] == holder["token"]
    finally:
        pids = _rank_pids(tag)
        first.kill()  # kill -9 of the whole job: nobody releases the lock
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        first.wait(timeout=30)
    assert (run / "run.lock").exists()
    # The holder is gone (same host): the next run takes over at once and says so.
    proc = train(2, run, "--resume", "auto", "--steps", "2", *MODEL, *QUIET)
    assert f"took over the lock of mpidist train rank 0 (pid {holder['pid']}" in proc.stderr
    assert [r["step"] for r in rows(run / "metrics.jsonl")] == [1, 2]  # no checkpoint: anew
    assert not (run / "run.lock").exists()
