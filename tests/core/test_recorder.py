"""The flight recorder (mpidist.core.recorder): the ring of recent calls with their step,
phase and completion, the dump (JSON and every thread's stack) on demand and on SIGUSR2,
the host:pid table learnt over a communicator, the watchdog's dumps of a rank blocked in a
collective and of a rank without progress, and the test hold's settings."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from mpidist.core import comms, recorder


@pytest.fixture
def installed(tmp_path: Path):
    """The recorder, dumping into ``tmp_path`` (the settings before are put back)."""
    before = recorder.install(directory=str(tmp_path))
    try:
        yield tmp_path
    finally:
        recorder.install(**before)


def _read(directory: Path, rank: int = 0) -> dict:
    return json.loads((directory / f"rank-{rank}.json").read_text())


def test_the_ring_keeps_the_calls_with_their_step_phase_and_completion(installed):
    d = comms.label(comms.world().Dup(), "ring test")
    try:
        comms.set_step(11)
        with comms.phase("backward"):
            d.Allreduce(comms.in_place(), np.ones(3))
        buf = np.zeros(2)
        req = d.Irecv(buf, source=d.Get_rank(), tag=7)
        pending = recorder.recent()[-1]
        assert (pending.op, pending.t_exit) == ("Irecv", None)
        snap = recorder.snapshot("test")
        assert snap["calls"][-1]["op"] == "Irecv" and snap["calls"][-1]["t_exit"] is None
        d.Send(np.ones(2), dest=d.Get_rank(), tag=7)
        comms.wait_all([req])
        mine = [c for c in recorder.recent() if c.comm == comms.comm_id(d)]
        assert [c.op for c in mine] == ["Allreduce", "Irecv", "Send"]
        assert (mine[0].step, mine[0].phase, mine[0].seq, mine[0].count) == (11, "backward",
                                                                             0, 3)
        assert all(c.t_exit is not None for c in mine)  # completion filled in place
        cid = comms.comm_id(d)
    finally:
        comms.set_step(-1)
        d.Free()
    recorder.step_done(11)
    snap = recorder.snapshot("after")
    # a freed communicator stays known, so that older calls in the ring can be placed
    (info,) = [c for c in snap["communicators"] if c["id"] == cid]
    assert info["label"] == "ring test" and info["coll_seq"] == 1
    assert info["members"] == list(range(comms.world().Get_size()))
    assert snap["steps_done"] == 11
    assert snap["recorder_size"] >= 1000


def test_a_dump_holds_the_ring_the_communicators_and_the_stacks(installed):
    w = comms.world()
    path = recorder.dump("on request")
    rank = w.Get_rank()
    assert path == str(installed / f"rank-{rank}.json")
    d = _read(installed, rank)
    assert d["format"] == recorder.FORMAT and d["reason"] == "on request"
    assert (d["world_rank"], d["pid"]) == (rank, os.getpid())
    assert d["ranks"][str(rank)] == f"{d['host']}:{os.getpid()}"
    assert "world" in {c["id"] for c in d["communicators"]}
    assert abs(d["time"] - time.time()) < 60
    assert all(abs(c["t_enter"] - d["time"]) < 3600 for c in d["calls"])  # wall clock
    assert any(s["name"] == "MainThread" and s["frames"] for s in d["stacks"])
    stacks = (installed / f"rank-{rank}.stacks.txt").read_text()
    assert "on request" in stacks and "most recent call first" in stacks


@pytest.mark.skipif(not hasattr(signal, "SIGUSR2"), reason="no SIGUSR2")
def test_sigusr2_dumps(installed):
    rank = comms.world().Get_rank()
    os.kill(os.getpid(), signal.SIGUSR2)
    deadline = time.monotonic() + 10
    target = installed / f"rank-{rank}.json"
    while not target.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _read(installed, rank)["reason"] == "SIGUSR2"


def test_hold_spec():
    assert recorder.hold_spec("rank=2,step=3,phase=backward") == {
        "rank": 2, "step": 3, "phase": "backward", "seconds": 3600.0}
    assert recorder.hold_spec("rank=0, seconds=1.5") == {
        "rank": 0, "step": None, "phase": None, "seconds": 1.5}
    for bad in ("step=3", "rank=x", "rank=1,when=now", "rank=1,step"):
        with pytest.raises(ValueError, match="MPIDIST_TEST_HOLD="):
            recorder.hold_spec(bad)


def test_a_negative_timeout_is_refused():
    with pytest.raises(ValueError, match="hang_timeout=-1"):
        recorder.install(timeout=-1)


@pytest.mark.mpi(min_size=2)
def test_every_rank_learns_every_ranks_host_and_pid():
    w = comms.world()
    recorder.install()
    recorder.introduce(w)
    snap = recorder.snapshot("table")
    tables = w.allgather(json.dumps([snap["ranks"], snap["job"]]))
    assert len(set(tables)) == 1  # the same table and job key everywhere
    mine = w.allgather(f"{snap['host']}:{os.getpid()}")
    assert snap["ranks"] == {str(r): hp for r, hp in enumerate(mine)}


@pytest.mark.mpi(min_size=2)
def test_the_watchdog_dumps_a_blocked_rank_and_one_without_progress(tmp_path: Path):
    w = comms.world()
    where = Path(comms.bcast_json(str(tmp_path), w))
    before = recorder.install(directory=str(where / "hang"), timeout=1.0)
    try:
        d = w.Dup()
        d.Barrier()
        if w.Get_rank() == 1:
            time.sleep(3.0)  # the others wait in the Barrier below
        comms.set_step(5)
        d.Barrier()
        seq, cid = comms.info(d).coll_seq - 1, comms.comm_id(d)
        d.Free()
        w.Barrier()
        got = _read(where / "hang", w.Get_rank())
        if w.Get_rank() == 1:
            assert got["reason"].startswith("hang: no progress for ")
        else:
            assert got["reason"].startswith(f"hang: inside Barrier on {cid} #{seq} ")
            assert got["inside"][0]["call"]["seq"] == seq
            assert got["inside"][0]["waiting_s"] >= 1.0
    finally:
        comms.set_step(-1)
        recorder.install(**before)
