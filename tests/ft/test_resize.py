"""Ranks lost during an elastic resize (``--strategy elastic``) on the ULFM stack.

The elastic strategy changes its membership itself and has no in-job recovery: a rank
SIGKILLed in the middle of a resize (a worker leaving, or workers spawned to join) ends the
job with a non-zero status and the same line on every survivor, never a hang (a worker that
has already left no longer answers an agreement). The checkpoint ``latest`` names is the
last complete one, and the restart from it (as the supervisor or a requeue does it) undoes
the resize: it runs at the size it is started with, on the single-process trajectory
(float64, 1e-9). Every job runs under a time limit.
"""

from __future__ import annotations

import pytest
from test_recovery import _rows, reference, text, train

EVERY = ("--checkpoint-interval", "1")


def _ended(job, out) -> None:
    """The job ended (no hang) with status 1 and step 1's checkpoint ``latest``."""
    assert not job.timed_out, job.report()
    assert job.returncode != 0, job.report()
    assert (out / "latest").read_text().strip() == "ckpt-00000001.h5"
    left = sorted(p.name for p in out.iterdir() if ".tmp-" in p.name)
    assert left == [], left


def _restart_continues(ulfm, tmp_path, monkeypatch, out, ref) -> None:
    """The restart from the last checkpoint at 4 ranks finishes on the reference."""
    again, _ = train(ulfm, tmp_path, monkeypatch, n=4, strategy="elastic", out=out,
                     extra=(*EVERY, "--max-workers", "5", "--resume"))
    assert again.returncode == 0, again.report()
    rows = {r["step"]: r["loss"] for r in _rows(out / "metrics.jsonl") if r["split"] == "train"}
    assert sorted(rows) == sorted(ref)
    assert max(abs(rows[s] - ref[s]) for s in ref) <= 1e-9
    events = _rows(out / "events.jsonl")
    resumed = [e for e in events if e["event"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["step"] == 1, events
    assert [e for e in events if e["event"] == "end"][-1]["world_size"] == 4, events


@pytest.mark.ft_smoke
def test_a_rank_lost_while_a_worker_leaves(ulfm, tmp_path, monkeypatch):
    """4 -> 3 workers after step 1; rank 1 dies in the rebuild on the new workers (its
    third MPI call of the resize) while rank 3 has already left."""
    ref = reference(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / "elastic-target").write_text("3\n")
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="elastic", out=out,
                     extra=EVERY, kill="rank=1,step=1,phase=resize,call=3")
    _ended(job, out)
    lines = {ln.split("mpidist train: error: ", 1)[1].split("; traceback")[0]
             for ln in text(job).splitlines() if "mpidist train: error: " in ln}
    assert lines == {"lost a rank in step 1 (resize); in-job recovery is off (ElasticOptimizer "
                     "changes its membership itself): restart from the last checkpoint (the "
                     "supervisor, --requeue or mpidist train --resume)"}, job.report()
    _restart_continues(ulfm, tmp_path, monkeypatch, out, ref)


@pytest.mark.parametrize("call", [1, 3])
def test_a_rank_lost_while_workers_join(ulfm, tmp_path, monkeypatch, call):
    """4 -> 5 workers after step 1 (one spawned); rank 2 dies before the spawn (call 1) or
    in the state's transfer to the grown job (call 3)."""
    ref = reference(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / "elastic-target").write_text("5\n")
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="elastic", out=out,
                     extra=(*EVERY, "--max-workers", "5"),
                     kill=f"rank=2,step=1,phase=resize,call={call}")
    _ended(job, out)
    _restart_continues(ulfm, tmp_path, monkeypatch, out, ref)
