"""Growing back after in-job recovery (``mpidist train`` on the ULFM stack).

A rank is killed (the library's kill points, ``MPIDIST_FT_KILL``); the survivors recover
in the job on 3 ranks, then at the next step boundary spawn a replacement, merge with it,
send it the position and the state (no checkpoint is read), make the copies anew and go
on at 4 ranks: the losses of every step equal a single-process run's (float64, 1e-9). A
target written to ``<out>/elastic-target`` caps the growth; a process lost during the join
is recovered (back to the pre-join mesh), and the join is tried again later. Processes
spawned into the job write their output as ranks 100, 101... (ftprog: 200... for a
second spawn); their own world ranks count from 0, so a kill point ``rank=0`` names the
first newcomer too (in the steps it takes part in).
"""

from __future__ import annotations

import json

import pytest
from test_recovery import LIMIT, _kill, _rows, check_recovered, reference, text, train


def _events(out) -> list[dict]:
    return _rows(out / "events.jsonl")


def check_grown(job, out, ref, *, lost: list[list[int]], grown: list[tuple[int, int]],
                size: int = 4, statuses: tuple[int, ...] = (0,)) -> list[dict]:
    """The run recovered from ``lost`` and grew back (``grown``: (from, to) per join),
    finishing on ``size`` ranks with the single-process losses; mpiexec's status one of
    ``statuses``."""
    if statuses == (0,):
        check_recovered(job, out, ref, lost=lost, size=size)
    else:
        events = _trained(job, out, ref, statuses=statuses)
        assert [e["lost"] for e in events if e["event"] == "recovered"] == lost, events
        assert [e["world_size"] for e in events if e["event"] == "end"] == [size], events
    events = _events(out)
    assert events[0]["regrow"].startswith("growing back on"), events[0]
    rows = [e for e in events if e["event"] == "grown"]
    assert [(e["from"], e["to"]) for e in rows] == grown, events
    for e in rows:
        assert 0 < e["spawn_s"] <= e["stall_s"] < 30, e
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == size, summary
    assert [(g["from"], g["to"]) for g in summary["grown"]] == grown, summary["grown"]
    assert "growing back on" in text(job)
    return rows


def test_the_stack_spawns_and_merges_after_a_shrink(ulfm):
    """What growing back stands on: Spawn and Merge on the survivors' shrunk
    communicator, under --with-ft ulfm (tests/ft/programs/spawn_after_shrink.py)."""
    job = ulfm("spawn_after_shrink.py", 4, timeout=60)
    assert not job.timed_out and job.returncode == 0, job.report()
    merged = job.each("merged")
    assert sorted(merged) == [0, 1, 3, 100], job.report()
    assert {e["size"] for e in merged.values()} == {4}, merged
    assert {e["sum"] for e in merged.values()} == {1 + 2 + 4 + 100}, merged
    assert 0 < merged[0]["spawn_s"] < 30, merged[0]


@pytest.mark.ft_smoke
def test_a_lost_rank_is_replaced(ulfm, tmp_path, monkeypatch):
    """zero2: rank 2 lost in step 3; 3 ranks redo it, then a newcomer joins: 4 ranks from
    step 4 on, each step once, the single-process trajectory."""
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2", regrow="spawn",
                     kill=_kill(2, 3, "backward"))
    (row,) = check_grown(job, out, ref, lost=[[2]], grown=[(3, 4)])
    assert row["step"] == 3 and row["joined"] == 1, row
    assert job.last(100, "step-4") is not None, job.report()  # the newcomer trained
    assert "grown back to 4 rank(s) after step 3" in job.out[0], job.report()


@pytest.mark.parametrize(("strategy", "phase"), [("ddp", "agreement"), ("zero1", "allgather"),
                                                 ("zero3", "forward")])
def test_every_level_grows_back(ulfm, tmp_path, monkeypatch, strategy, phase):
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy=strategy, regrow="spawn",
                     kill=_kill(1, 2, phase))
    check_grown(job, out, ref, lost=[[1]], grown=[(3, 4)])


def test_a_smaller_target_means_no_growing(ulfm, tmp_path, monkeypatch):
    """``3`` in <out>/elastic-target (read and deleted by rank 0): the job stays at 3."""
    ref = reference(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / "elastic-target").write_text("3\n")
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2", out=out, regrow="spawn",
                     kill=_kill(2, 3, "backward"))
    check_recovered(job, out, ref, lost=[[2]], size=3)
    assert not [e for e in _events(out) if e["event"] in ("grown", "join_abandoned")]
    assert not (out / "elastic-target").exists()
    assert 100 not in job.events, job.report()  # nothing was spawned


def _trained(job, out, ref, *, killed_newcomer: bool = False,
             statuses: tuple[int, ...] = (0,)) -> list[dict]:
    """Each step once with the single-process losses; the events. ``killed_newcomer``:
    mpiexec's status is 137 (Open MPI counts a spawned process that was killed in the
    launcher's status, although the job went on; the harness reads 137 as its own time
    limit, so the time is checked here)."""
    if killed_newcomer:
        assert job.returncode == 137 and job.elapsed < LIMIT, job.report()
        assert "signal 9" in job.launcher_err, job.report()
    else:
        assert not job.timed_out and job.returncode in statuses, job.report()
    rows = [r for r in _rows(out / "metrics.jsonl") if r["split"] == "train"]
    assert [r["step"] for r in rows] == sorted(ref), job.report()
    worst = max(abs(r["loss"] - ref[r["step"]]) for r in rows)
    assert worst <= 1e-9, f"losses differ from the single-process run by {worst}"
    return _events(out)


def test_a_newcomer_lost_during_the_join(ulfm, tmp_path, monkeypatch):
    """The newcomer dies in its second MPI call of the join after step 3 (building the
    model): the survivors go back to their 3-rank mesh and state (nothing redone), wait 2
    steps and grow after step 5 with a new newcomer. mpiexec's status is the killed
    spawned process's (137: Open MPI counts a spawned job's lost process in the launcher's
    status although the job went on)."""
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2", regrow="spawn",
                     kill=_kill(2, 3, "backward") + ";rank=0,step=3,phase=join,call=2")
    events = _trained(job, out, ref, killed_newcomer=True)
    assert "SIGKILL" in job.err.get(100, ""), job.report()
    assert [e["lost"] for e in events if e["event"] == "recovered"] == [[2], []], events
    (gone,) = [e for e in events if e["event"] == "join_abandoned"]
    assert gone["step"] == 3 and gone["failures"] == 1 and gone["retry_at"] == 5, gone
    (grown,) = [e for e in events if e["event"] == "grown"]
    assert (grown["step"], grown["from"], grown["to"]) == (5, 3, 4), grown
    assert job.last(200, "step-6") is not None, job.report()
    (end,) = [e for e in events if e["event"] == "end"]
    assert end["world_size"] == 4, events


@pytest.mark.parametrize("call", [3, 21])
def test_a_survivor_lost_during_the_join(ulfm, tmp_path, monkeypatch, call):
    """Rank 1 dies in the join after step 3 (its 3rd MPI call of the join, before the
    state moves, or its 21st, making the grown mesh's copies after the survivors took the
    grown model): the survivors recover from the pre-join layout (rank 1's state from its
    copy) on 2 ranks, the newcomer of the abandoned join exits, and after step 5 two
    newcomers bring the job back to 4."""
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2", regrow="spawn",
                     kill=_kill(2, 3, "backward") + f";rank=1,step=3,phase=grow,call={call}")
    events = _trained(job, out, ref)
    assert [e["lost"] for e in events if e["event"] == "recovered"] == [[2], [1]], events
    (gone,) = [e for e in events if e["event"] == "join_abandoned"]
    assert gone["step"] == 3, gone
    grown = [(e["step"], e["from"], e["to"]) for e in events if e["event"] == "grown"]
    assert grown == [(5, 2, 4)], events
    (end,) = [e for e in events if e["event"] == "end"]
    assert end["world_size"] == 4, events
    assert "went on without this process" in job.err.get(100, ""), job.report()


def test_a_second_loss_after_growing_back(ulfm, tmp_path, monkeypatch):
    """Rank 2 lost in step 2, a newcomer joins after it; rank 3 lost in step 5: the
    survivors (the newcomer among them) recover and grow back again after step 5."""
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero1", regrow="spawn",
                     kill=_kill(2, 2, "backward") + ";" + _kill(3, 5, "optimizer"))
    # The first newcomer outlived a failure: it ends without MPI_Finalize (Open MPI 5.0's
    # crashes in ompi_dpm_dyn_finalize then), which the launcher may count (status 1).
    check_grown(job, out, ref, lost=[[2], [3]], grown=[(3, 4), (3, 4)], statuses=(0, 1))
    assert job.last(100, "step-6") is not None and job.last(200, "step-6") is not None


def test_an_asynchronous_save_in_flight_commits_before_the_join(ulfm, tmp_path, monkeypatch):
    """A background save every step: the one of step 2 is abandoned by the recovery (in
    flight when rank 2 is lost in step 3); the one of step 3, in flight at the join,
    commits over the 3 survivors before it; the later ones are written by the 4 ranks."""
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2", regrow="spawn",
                     extra=("--checkpoint-interval", "1", "--checkpoint-async"),
                     kill=_kill(2, 3, "backward"))
    check_grown(job, out, ref, lost=[[2]], grown=[(3, 4)])
    events = _events(out)
    saved = {e["step"]: e["world_size"] for e in events if e["event"] == "checkpoint"}
    assert saved == {1: 4, 3: 3, 4: 4, 5: 4, 6: 4}, saved
    assert [e["step"] for e in events if e["event"] == "checkpoint_abandoned"] == [2]
    kinds = [(e["event"], e.get("step")) for e in events]
    assert kinds.index(("checkpoint", 3)) < kinds.index(("grown", 3)), kinds
    assert (out / "latest").read_text().strip() == "ckpt-00000006.h5"


def test_a_refused_spawn_goes_on_smaller(ulfm, tmp_path, monkeypatch):
    """Replacements that cannot be started (the program to spawn does not exist, as with no
    free slots): ``Spawn`` fails by itself, nothing changed; the job goes on at 3 ranks on
    the single-process trajectory and tries again later (after steps 2, then 4; the next
    try, after step 8, is past the end). mpiexec's status says the spawn failed (183 here)
    although the job finished: the summary says what happened."""
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2", regrow="spawn",
                     kill=_kill(2, 2, "backward"), program="refused_spawn.py")
    assert not job.timed_out, job.report()
    rows = {r["step"]: r["loss"] for r in _rows(out / "metrics.jsonl") if r["split"] == "train"}
    assert sorted(rows) == sorted(ref), job.report()
    assert max(abs(rows[s] - ref[s]) for s in ref) <= 1e-9
    events = _events(out)
    refused = [e for e in events if e["event"] == "grow_refused"]
    assert [(e["step"], e["failures"], e["retry_at"]) for e in refused] == [(2, 1, 4),
                                                                            (4, 2, 8)], events
    assert all(e["reason"].startswith("spawning 1 process(es) failed: ") for e in refused)
    assert not [e for e in events if e["event"] == "grown"], events
    (end,) = [e for e in events if e["event"] == "end"]
    assert end["world_size"] == 3, events
    assert json.loads((out / "summary.json").read_text())["world_size"] == 3
    assert "growing back failed after step 2 (spawning 1 process(es) failed" in text(job)
    assert "trying again after step 4" in text(job)
