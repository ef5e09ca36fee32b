"""The run directory's lock (mpidist.run.lock): one holder, a lease renewed by a thread, a
stale lock recognised without a PID check across nodes, and the pure resume decisions."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from mpidist.run.config import TrainConfig
from mpidist.run.directory import drop_rows_after
from mpidist.run.lock import LOCK_NAME, LockHeldError, RunLock, read_lock, stale_reason
from mpidist.run.resume import NothingToDo, decide_start, resolve_settings


def _fake_lock(d: Path, **fields) -> dict:
    info = {"holder": "mpidist train rank 0", "host": "node-elsewhere", "pid": 4242,
            "token": "feedbeef", "lease_s": 10.0, "started": time.time(),
            "renewed": time.time(), **fields}
    (d / LOCK_NAME).write_text(json.dumps(info))
    return info


def test_acquire_release_and_a_second_holder_is_refused(tmp_path: Path):
    a = RunLock(str(tmp_path), "mpidist train rank 0")
    a.acquire()
    info = read_lock(str(tmp_path))
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
    assert info["token"] == a.token
    b = RunLock(str(tmp_path), "mpidist train rank 0")
    with pytest.raises(LockHeldError, match=rf"--out {tmp_path} is in use by mpidist train "
                                            rf"rank 0 \(pid {os.getpid()} on "):
        b.acquire()
    a.release()
    assert not (tmp_path / LOCK_NAME).exists()
    assert sorted(os.listdir(tmp_path)) == []  # no temporary files left behind
    b.acquire()  # free again
    b.release()


def _until(done, seconds: float = 10.0) -> None:
    """Wait until ``done()`` (at most ``seconds``; the assertion after it says what failed)."""
    end = time.monotonic() + seconds
    while not done() and time.monotonic() < end:
        time.sleep(0.02)


def test_the_lease_is_renewed_and_a_takeover_is_noticed(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MPIDIST_LOCK_LEASE_S", "0.05")
    lock = RunLock(str(tmp_path), "mpidist train rank 0")
    lock.acquire()
    first = read_lock(str(tmp_path))["renewed"]
    _until(lambda: read_lock(str(tmp_path))["renewed"] > first)
    assert read_lock(str(tmp_path))["renewed"] > first
    _fake_lock(tmp_path, token="someoneelse", renewed=time.time())  # another run took it
    _until(lambda: bool(lock.lost))  # (the renewing thread runs late on a loaded machine)
    assert lock.lost.startswith("mpidist train rank 0 (pid 4242 on node-elsewhere")
    lock.release()
    assert read_lock(str(tmp_path))["token"] == "someoneelse"  # not ours: left alone


def test_a_lock_from_another_node_is_stale_only_when_not_renewed(tmp_path: Path):
    _fake_lock(tmp_path)  # alive on another node (its PID means nothing here)
    with pytest.raises(LockHeldError, match="node-elsewhere"):
        RunLock(str(tmp_path), "mpidist train rank 0").acquire()
    old = _fake_lock(tmp_path, renewed=time.time() - 41)
    assert stale_reason(old) == "not renewed for 41 s"
    lock = RunLock(str(tmp_path), "mpidist train rank 0")
    lock.acquire()
    assert read_lock(str(tmp_path))["pid"] == os.getpid()
    lock.release()


def test_a_dead_process_on_this_host_is_stale_at_once(tmp_path: Path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(proc.stdout)
    info = _fake_lock(tmp_path, host=socket.gethostname(), pid=dead,
                      pidns=os.stat("/proc/self/ns/pid").st_ino)
    assert stale_reason(info) == f"process {dead} on this host is gone"
    mine = _fake_lock(tmp_path, host=socket.gethostname(), pid=os.getpid(),
                      pidns=os.stat("/proc/self/ns/pid").st_ino)
    assert stale_reason(mine) == ""


def test_a_requeued_slurm_job_takes_over_its_earlier_start(tmp_path: Path, monkeypatch):
    _fake_lock(tmp_path, slurm_job_id="77", slurm_restart_count=0)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    with pytest.raises(LockHeldError, match="Slurm job 77"):
        RunLock(str(tmp_path), "mpidist train rank 0").acquire()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock = RunLock(str(tmp_path), "mpidist train rank 0")
    lock.acquire()
    assert read_lock(str(tmp_path))["slurm_restart_count"] == 1
    lock.release()


def test_a_supervisors_lock_is_inherited_and_kept(tmp_path: Path):
    sup = RunLock(str(tmp_path), "mpidist run --elastic")
    sup.acquire()
    job = RunLock(str(tmp_path), "mpidist train rank 0")
    job.acquire(inherit=sup.token)
    assert job.inherited
    job.release()
    assert read_lock(str(tmp_path))["holder"] == "mpidist run --elastic"
    sup.release()


def test_drop_rows_after_is_atomic_and_leaves_a_clean_file_alone(tmp_path: Path):
    f = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0} for s in (1, 2, 3, 4)] + [{"event": "x", "step": None}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')
    assert drop_rows_after(str(f), 2) == 3  # steps 3, 4 and the torn line
    assert [json.loads(x).get("step") for x in f.read_text().splitlines()] == [1, 2, None]
    before = f.stat().st_mtime_ns
    assert drop_rows_after(str(f), 2) == 0
    assert f.stat().st_mtime_ns == before
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


def _state(**kw) -> dict:
    base = {"exists": True, "checkpoints": ["ckpt-00000040.h5"],
            "latest": "runs/z1/ckpt-00000040.h5", "step": 40, "world_size": 4,
            "dtype": "float64", "optimizer": "adamw", "outputs": ["metrics.jsonl"], "error": "",
            "train_config": {**TrainConfig(strategy="hybrid", pp=2, schedule="interleaved",
                                           virtual_stages=2, recompute="blocks",
                                           dtype="float64", n_embd=32,
                                           steps=600).__dict__, "lr_decay_steps": 600}}
    base.update(kw)
    return base


def test_decisions_start_resume_refuse():
    cfg = TrainConfig(out="runs/z1")
    with pytest.raises(ValueError, match=r"^--out runs/z1 holds 1 checkpoint of a run "
                                         r"\(latest ckpt-00000040.h5, step 40\); continue it "
                                         r"with --resume"):
        decide_start(cfg, _state(), restart=False)
    assert decide_start(TrainConfig(out="runs/z1", overwrite=True), _state(), False) == "start"
    assert decide_start(TrainConfig(out="runs/z1", resume=True), _state(), False) == "resume"
    empty = _state(checkpoints=[], latest=None, step=None, outputs=[])
    assert decide_start(TrainConfig(out="runs/z1", resume="auto"), empty, False) == "start"
    assert decide_start(cfg, empty, restart=True) == "start"
    assert decide_start(TrainConfig(out="runs/z1", overwrite=True), _state(), True) == "resume"
    with pytest.raises(ValueError, match="^--resume: --out runs/z1 holds no checkpoint"):
        decide_start(TrainConfig(out="runs/z1", resume=True), empty, False)
    with pytest.raises(ValueError, match="contradict"):
        decide_start(TrainConfig(out="runs/z1", resume=True, overwrite=True), _state(), False)


def test_resolve_takes_the_checkpoints_settings():
    cfg = TrainConfig(out="runs/z1", resume=True, steps=4000)
    new, notes = resolve_settings(cfg, {"out", "resume", "steps"}, _state(), world_size=3)
    assert (new.strategy, new.dtype, new.n_embd, new.steps) == ("hybrid", "float64", 32, 4000)
    assert (new.pp, new.schedule, new.virtual_stages, new.recompute) == \
        (2, "interleaved", 2, "blocks")  # the whole layout, not only the strategy's name
    # another --schedule comes with its own chunks per stage (one, unless given)
    new, _ = resolve_settings(TrainConfig(out="runs/z1", resume=True, steps=4000,
                                          schedule="1f1b"),
                              {"out", "resume", "steps", "schedule"}, _state(), 3)
    assert (new.schedule, new.virtual_stages, new.pp) == ("1f1b", 1, 2)
    assert new.lr_decay_steps == 600 and notes == []
    asks = TrainConfig(out="runs/z1", resume=True, dtype="float32", n_embd=32, lr=1e-3)
    with pytest.raises(ValueError) as err:
        resolve_settings(asks, {"dtype", "n_embd", "lr"}, _state(), 3)
    assert str(err.value) == ("checkpoint runs/z1/ckpt-00000040.h5 was trained with --dtype "
                              "float64; this run asks for --dtype float32")
    new, notes = resolve_settings(asks, {"lr", "n_embd"}, _state(), 3)
    assert notes == ["--lr 0.001 (the checkpoint was trained with --lr 0.003)"]
    with pytest.raises(NothingToDo, match="is at step 40 and --steps is 40: nothing to do"):
        resolve_settings(TrainConfig(out="runs/z1", steps=40), {"steps"}, _state(), 4)
    # --strategy given: the layout comes from the flags, not the checkpoint.
    new, _ = resolve_settings(TrainConfig(strategy="ddp"), {"strategy"}, _state(), 3)
    assert new.strategy == "ddp" and new.dtype == "float64"


def test_the_lock_of_an_ended_slurm_job_is_stale(tmp_path: Path, monkeypatch):
    """The next segment of a resume chain, after a segment SIGKILLed at its time limit on
    another node: squeue says the holder's job has ended."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    squeue.write_text('#!/bin/sh\necho "$FAKE_SQUEUE_STATE"\n')
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    run = tmp_path / "run"
    run.mkdir()
    info = _fake_lock(run, slurm_job_id="77", slurm_restart_count=0)
    monkeypatch.setenv("FAKE_SQUEUE_STATE", "RUNNING")
    assert stale_reason(info) == ""
    monkeypatch.setenv("FAKE_SQUEUE_STATE", "")
    assert stale_reason(info) == "Slurm job 77 has ended"
