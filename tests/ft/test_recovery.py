"""In-job recovery from a lost rank (``mpidist train`` and the library) on the ULFM stack.

A rank is SIGKILLed at a named phase of a step (the library's kill points,
``MPIDIST_FT_KILL``) or from outside by its pid; the survivors revoke, shrink, agree,
rebuild the model on themselves from their snapshots and the buddies' copies, redo the
interrupted step, and finish: the losses of every step equal a single-process run's
(float64, 1e-9) and no checkpoint was read. What cannot be recovered ends the job in one
line, and a restart from the last checkpoint continues the same trajectory. On Debian's
Open MPI 4.1 the same command behaves as before, with one line saying why recovery is off.
Every job runs under a time limit (ulfm_harness).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ARGS = ("--steps", "6", "--dtype", "float64", "--n-layer", "2", "--n-embd", "32", "--n-head",
        "2", "--block-size", "16", "--global-batch", "12", "--eval-interval", "0",
        "--eval-batches", "1", "--no-progress")
LIMIT = 150
_REFERENCE: dict[tuple[str, ...], dict[int, float]] = {}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def reference(tmp: Path, args: tuple[str, ...] = ARGS) -> dict[int, float]:
    """The single-process losses of ``mpidist train`` with ``args`` (once per session)."""
    if args not in _REFERENCE:
        out = tmp / f"reference-{len(_REFERENCE)}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MPIDIST_FT")}
        env["PYTHONPATH"] = str(REPO)
        proc = subprocess.run([sys.executable, "-m", "mpidist", "train", *args, "--out",
                               str(out), "--checkpoint-interval", "0"], capture_output=True,
                              text=True, timeout=LIMIT, env=env, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        _REFERENCE[args] = {r["step"]: r["loss"] for r in _rows(out / "metrics.jsonl")
                            if r["split"] == "train"}
    return _REFERENCE[args]


def train(ulfm, tmp_path: Path, monkeypatch, n: int = 4, *, strategy: str, kill: str = "",
          extra: tuple[str, ...] = (), out: Path | None = None, regrow: str = "none",
          program: str = "train.py", **kw):
    """``mpidist train`` on ``n`` ranks (ulfm_harness; ``program``: a file of
    tests/ft/programs that runs it), ``MPIDIST_FT_KILL=kill``; the survivors go on smaller
    unless ``regrow="spawn"`` (tests/ft/test_grow.py)."""
    if kill:
        monkeypatch.setenv("MPIDIST_FT_KILL", kill)
    else:
        monkeypatch.delenv("MPIDIST_FT_KILL", raising=False)
    out = out or tmp_path / "run"
    job = ulfm(program, n, args=("train", *ARGS, "--strategy", strategy, "--out",
                                    str(out), "--regrow", regrow, *extra),
              timeout=kw.pop("timeout", LIMIT), **kw)
    return job, out


def text(job) -> str:
    return job.launcher_out + job.launcher_err + "".join(job.out.values()) \
        + "".join(job.err.values())


def check_recovered(job, out: Path, ref: dict[int, float], *, lost: list[list[int]],
                    size: int) -> list[dict]:
    """The run finished on ``size`` ranks after losing ``lost`` (one list per recovery),
    with the reference's losses, each step once, no checkpoint read."""
    assert not job.timed_out, job.report()
    assert job.returncode == 0, job.report()
    rows = [r for r in _rows(out / "metrics.jsonl") if r["split"] == "train"]
    assert [r["step"] for r in rows] == sorted(ref), job.report()
    worst = max(abs(r["loss"] - ref[r["step"]]) for r in rows)
    assert worst <= 1e-9, f"losses differ from the single-process run by {worst}"
    events = _rows(out / "events.jsonl")
    kinds = [e["event"] for e in events]
    assert "resume" not in kinds, kinds
    assert kinds[0] == "start" and events[0]["fault_tolerance"].startswith("on (Open MPI v5")
    assert events[0]["recovery"].startswith("in-job recovery on (--redundancy buddy"), events
    recovered = [e for e in events if e["event"] == "recovered"]
    assert [e["lost"] for e in recovered] == lost, events
    for e in recovered:
        assert e["redo_s"] is not None and e["total_s"] < 10, e
    end = [e for e in events if e["event"] == "end"]
    assert len(end) == 1 and end[0]["world_size"] == size, events
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == size and len(summary["recoveries"]) == len(lost)
    assert not (out / "run.lock").exists(), "the lock was not given back by the new rank 0"
    assert "in-job recovery on (--redundancy buddy" in text(job)
    return recovered


SMOKE = [("ddp", "agreement"), ("zero1", "allgather"), ("zero2", "backward"),
         ("zero3", "forward")]
PHASES = ("forward", "backward", "update:0", "allgather", "optimizer", "agreement")
MATRIX = [(s, p) for s in ("ddp", "zero1", "zero2", "zero3") for p in PHASES
          if (s, p) not in SMOKE and not (p == "allgather" and s in ("ddp", "zero3"))]


def _kill(rank: int, step: int, phase: str) -> str:
    name, _, call = phase.partition(":")
    return f"rank={rank},step={step},phase={name}" + (f",call={call}" if call else "")


@pytest.mark.ft_smoke
@pytest.mark.parametrize(("strategy", "phase"), SMOKE)
def test_a_lost_rank_costs_nothing(ulfm, tmp_path, monkeypatch, strategy, phase):
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy=strategy, kill=_kill(2, 3, phase))
    assert job.last(2, "step-3") is not None and job.last(2, "step-4") is None, job.report()
    check_recovered(job, out, ref, lost=[[2]], size=3)


@pytest.mark.parametrize(("strategy", "phase"), MATRIX)
def test_every_phase(ulfm, tmp_path, monkeypatch, strategy, phase):
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy=strategy, kill=_kill(1, 4, phase))
    check_recovered(job, out, ref, lost=[[1]], size=3)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_killed_from_outside_by_pid(ulfm, tmp_path, monkeypatch, strategy):
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy=strategy, kill_on=(3, "step-3"))
    assert 3 in job.killed, job.report()
    check_recovered(job, out, ref, lost=[[3]], size=3)


def test_rank_0_killed(ulfm, tmp_path, monkeypatch):
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero1",
                     kill=_kill(0, 3, "optimizer"))
    (rec,) = check_recovered(job, out, ref, lost=[[0]], size=3)
    assert rec["step"] == 2, rec
    # rank 1, rank 0 of the survivors, wrote the summary and printed the run's lines
    assert "== mpidist train summary ==" in job.out[1], job.report()
    assert "3 rank(s) go on from step 2" in job.out[1], job.report()


def test_two_kills_at_different_steps(ulfm, tmp_path, monkeypatch):
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero3",
                     kill=_kill(1, 2, "backward") + ";" + _kill(3, 5, "optimizer"))
    check_recovered(job, out, ref, lost=[[1], [3]], size=2)


def test_a_rank_and_the_holder_of_its_copy_killed_together(ulfm, tmp_path, monkeypatch):
    """One clear line and a non-zero status; the restart from the last checkpoint (as the
    supervisor or a requeue does it) continues the same trajectory."""
    ref = reference(tmp_path)
    every2 = ("--checkpoint-interval", "2")
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2", extra=every2,
                     kill=_kill(1, 4, "backward") + ";" + _kill(2, 4, "backward"))
    assert not job.timed_out, job.report()
    assert job.returncode == 1, job.report()
    lines = [ln for ln in text(job).splitlines() if "mpidist train: error:" in ln]
    assert len(lines) == 1, job.report()
    assert "rank 1 and rank 2, which held its copy, died together" in lines[0], lines
    assert "restart from the last checkpoint" in lines[0], lines
    again, _ = train(ulfm, tmp_path, monkeypatch, n=3, strategy="zero2", out=out,
                     extra=(*every2, "--resume"))
    assert again.returncode == 0, again.report()
    rows = {r["step"]: r["loss"] for r in _rows(out / "metrics.jsonl") if r["split"] == "train"}
    assert sorted(rows) == sorted(ref)
    assert max(abs(rows[s] - ref[s]) for s in ref) <= 1e-9
    assert [e["event"] for e in _rows(out / "events.jsonl")].count("resume") == 1


def test_a_check_failing_on_a_dead_ranks_garbage_is_a_lost_rank(ulfm, tmp_path, monkeypatch):
    """ULFM can return success from a collective on a survivor with a dead member's part
    unwritten; the batch check then fails on garbage before any MPI call reports the
    loss (seen across nodes). Rank 1's check gets such a table while rank 3 dies: the
    survivors recover, on the single-process trajectory."""
    ref = reference(tmp_path)
    monkeypatch.setenv("GARBLED_STEP", "4")
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2",
                     kill=_kill(3, 4, "backward:0"), program="garbled_check.py")
    check_recovered(job, out, ref, lost=[[3]], size=3)
    assert job.each("garbled"), job.report()


@pytest.mark.parametrize("earlier", [0, 2])
def test_a_rank_failing_alone(ulfm, tmp_path, monkeypatch, earlier):
    """The same garbage where no rank died is the rank's own error: its line, then, since
    ``MPI_Abort`` under ULFM before any failure ends nothing and tells no one, the rank
    leaves (SIGKILL) and the others recover without it, on the single-process trajectory.
    After a failure (one recovered at an earlier step) ``MPI_Abort`` ends the job again,
    with the rank's line and its status."""
    ref = reference(tmp_path)
    monkeypatch.setenv("GARBLED_STEP", "4")
    monkeypatch.setenv("GARBLED_WAIT", "0")
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2",
                     program="garbled_check.py",
                     kill=_kill(3, earlier, "backward") if earlier else "")
    lines = [ln for ln in text(job).splitlines() if "mpidist train: error:" in ln]
    assert len(lines) == 1, job.report()
    assert "has a local batch of -9223372036854775808 samples" in lines[0], lines
    if earlier:
        assert not job.timed_out and job.returncode == 2, job.report()
        assert "aborting the MPI job (exit code 2)" in lines[0], lines
        assert "lost rank 3; 3 rank(s) go on" in text(job), job.report()
        return
    check_recovered(job, out, ref, lost=[[1]], size=3)
    assert "leaving the job (status 2; under fault tolerance" in lines[0], lines


@pytest.mark.parametrize(("second", "call"), [(3, 4), (2, 1)])
def test_a_second_death_during_the_recovery(ulfm, tmp_path, monkeypatch, second, call):
    """Rank 3 dying in the recovery from rank 1 (in its call-th MPI call there): the
    recovery starts over and loses both; rank 2, the holder of rank 1's copy: one line."""
    ref = reference(tmp_path)
    kill = _kill(1, 3, "backward") + ";" + f"rank={second},step=3,phase=recovery,call={call}"
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2", kill=kill)
    assert job.last(second, "step-3") is not None and job.last(second, "step-4") is None
    if second == 3:
        check_recovered(job, out, ref, lost=[[1, 3]], size=2)
        return
    assert not job.timed_out and job.returncode == 1, job.report()
    lines = [ln for ln in text(job).splitlines() if "mpidist train: error:" in ln]
    assert len(lines) == 1, job.report()
    assert "rank 1 and rank 2, which held its copy, died together" in lines[0], lines


def test_an_asynchronous_save_in_flight_is_abandoned(ulfm, tmp_path, monkeypatch):
    """Rank 0 killed in step 5 while the background write of step 4's checkpoint is held
    mid-write (the writer hook): the survivors abandon that save (its communicator is
    revoked), the new rank 0 records it, ``latest`` stays step 2's until the final save,
    and the trajectory is the single-process one."""
    ref = reference(tmp_path)
    monkeypatch.setenv("MPIDIST_CHECKPOINT_WRITER_HOOK", "point=mid-write,action=stop,step=4")
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2",
                     extra=("--checkpoint-interval", "2", "--checkpoint-async"),
                     kill=_kill(0, 5, "forward"))
    check_recovered(job, out, ref, lost=[[0]], size=3)
    events = _rows(out / "events.jsonl")
    saved = [e["step"] for e in events if e["event"] == "checkpoint"]
    assert saved == [2, 6], events
    (gone,) = [e for e in events if e["event"] == "checkpoint_abandoned"]
    assert gone["step"] == 4 and gone["at_step"] == 4, gone
    assert (out / "latest").read_text().strip() == "ckpt-00000006.h5"
    left = sorted(p.name for p in out.iterdir() if ".tmp-" in p.name)
    assert left == [], left  # the final save deleted the abandoned temp file


def test_redundancy_none_ends_the_job_in_one_line(ulfm, tmp_path, monkeypatch):
    job, _ = train(ulfm, tmp_path, monkeypatch, strategy="zero2",
                   extra=("--redundancy", "none"), kill=_kill(2, 3, "backward"))
    assert not job.timed_out and job.returncode == 1, job.report()
    assert "in-job recovery off: --redundancy none keeps no copies" in text(job)
    lines = [ln for ln in text(job).splitlines() if "mpidist train: error:" in ln]
    assert len(lines) == 1 and "lost rank 2 in step 3" in lines[0], job.report()


@pytest.mark.parametrize("level", [1, 3])
def test_the_library_user_loop_and_optimize(ulfm, tmp_path, monkeypatch, level):
    monkeypatch.setenv("MPIDIST_FT_KILL", _kill(3, 2, "backward") + ";" + _kill(0, 6, "*"))
    job = ulfm("user_loop.py", 4, args=(str(level),), timeout=LIMIT)
    assert not job.timed_out and job.returncode == 0, job.report()
    for r in (1, 2):
        got = job.last(r, "losses")
        assert got is not None, job.report()
        assert got["maxdiff"] <= 1e-9, got
        assert got["changes"] == [{"step": 1, "dead": [3], "size": 3}], got
        assert got["size"] == 2, got  # optimize recovered from rank 0 by itself


def test_the_library_abandons_an_asynchronous_save_in_flight(ulfm, tmp_path, monkeypatch):
    """``opt.save(..., async_=True)`` after step 1, its writer held mid-write, rank 3 lost
    in step 2: the recovery abandons the save on every survivor (no checkpoint, no
    ``latest``), and the trajectory is the single-process one."""
    monkeypatch.setenv("MPIDIST_FT_KILL", _kill(3, 2, "backward"))
    monkeypatch.setenv("MPIDIST_CHECKPOINT_WRITER_HOOK", "point=mid-write,action=stop,step=1")
    job = ulfm("user_loop.py", 4, args=("2", str(tmp_path)), timeout=LIMIT)
    assert not job.timed_out and job.returncode == 0, job.report()
    for r in (0, 1, 2):
        got = job.last(r, "losses")
        assert got is not None, job.report()
        assert got["maxdiff"] <= 1e-9, got
        assert got["changes"] == [{"step": 1, "dead": [3], "size": 3}], got
        assert got["save"] == {"abandoned": True, "committed": False}, got
    assert not (tmp_path / "ckpt-1.h5").exists() and not (tmp_path / "latest").exists()


def test_the_same_command_on_open_mpi_4_behaves_as_before(ulfm, tmp_path, monkeypatch):
    import shutil

    if shutil.which("mpiexec") is None:
        pytest.skip("no system mpiexec on PATH")
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2", stack="system")
    assert job.returncode == 0, job.report()
    assert "in-job recovery off: Open MPI v4" in text(job), job.report()
    rows = [r for r in _rows(out / "metrics.jsonl") if r["split"] == "train"]
    assert max(abs(r["loss"] - ref[r["step"]]) for r in rows) <= 1e-9
    lost, _ = train(ulfm, tmp_path, monkeypatch, strategy="zero2", stack="system",
                    out=tmp_path / "lost", kill_on=(2, "step-3"))
    # mpiexec ends the job (its status 137, 128 + SIGKILL, reads as a time-out to the
    # harness: the elapsed time says it was not one)
    assert lost.elapsed < LIMIT / 2 and lost.returncode != 0, lost.report()
    assert "mpiexec noticed that process rank 2" in lost.launcher_err, lost.report()
    assert not (tmp_path / "lost" / "summary.json").exists()
