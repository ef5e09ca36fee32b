"""Growing back after in-job recovery (``mpidist train`` on the ULFM stack).

A rank is killed (the library's kill points, ``MPIDIST_FT_KILL``); the survivors recover
in the job on 3 ranks, then at the next step boundary spawn a replacement, merge with it,
send it the position and the state (no checkpoint is read), make the copies anew and go
on at 4 ranks: the losses of every step equal a single-process run's (float64, 1e-9). A
target written to ``<out>/elastic-target`` caps the growth; a process lost during the join
is recovered (back to the pre-join mesh), and the join is tried again later. Processes
spawned into the job write their output as ranks 100, 101... (ftprog).
"""

from __future__ import annotations

import json

import pytest
from test_recovery import _kill, _rows, check_recovered, reference, text, train


def _events(out) -> list[dict]:
    return _rows(out / "events.jsonl")


def check_grown(job, out, ref, *, lost: list[list[int]], grown: list[tuple[int, int]],
                size: int = 4) -> list[dict]:
    """The run recovered from ``lost`` and grew back (``grown``: (from, to) per join),
    finishing on ``size`` ranks with the single-process losses."""
    check_recovered(job, out, ref, lost=lost, size=size)
    events = _events(out)
    assert events[0]["regrow"].startswith("growing back on"), events[0]
    rows = [e for e in events if e["event"] == "grown"]
    assert [(e["from"], e["to"]) for e in rows] == grown, events
    for e in rows:
        assert 0 < e["spawn_s"] <= e["stall_s"] < 30, e
    summary = json.loads((out / "summary.json").read_text())
    assert [(g["from"], g["to"]) for g in summary["grown"]] == grown, summary["grown"]
    assert "growing back on" in text(job)
    return rows


@pytest.mark.ft_smoke
def test_a_lost_rank_is_replaced(ulfm, tmp_path, monkeypatch):
    """zero2: rank 2 lost in step 3; 3 ranks redo it, then a newcomer joins: 4 ranks from
    step 4 on, each step once, the single-process trajectory."""
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2", kill=_kill(2, 3, "backward"))
    (row,) = check_grown(job, out, ref, lost=[[2]], grown=[(3, 4)])
    assert row["step"] == 3 and row["joined"] == 1, row
    assert job.last(100, "step-4") is not None, job.report()  # the newcomer trained
    assert "grown back to 4 rank(s) after step 3" in job.out[0], job.report()
