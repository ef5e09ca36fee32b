"""Ranks lost during a checkpoint save, in ``mpidist train`` on the ULFM stack.

A rank SIGKILLed in the middle of its bytes of a blocking posix save (the checkpoint
writer hook's ``kill``), or in the background write of an asynchronous one: the survivors
recover in the job, the interrupted save is abandoned (its temp file deleted, ``latest``
still the previous checkpoint), training goes on with the single-process losses (float64,
1e-9) and the next save completes. Under MPI-IO (``MPIDIST_CHECKPOINT_IO=mpio``), which is
not promised to survive a failure, the job ends in one line with the previous checkpoint
``latest``, and a restart continues the same trajectory. Every job runs under a time limit.
"""

from __future__ import annotations

import pytest
from test_recovery import _kill, _rows, check_recovered, reference, text, train

EVERY2 = ("--checkpoint-interval", "2")


def _saves(out) -> tuple[list[int], list[dict]]:
    events = _rows(out / "events.jsonl")
    return ([e["step"] for e in events if e["event"] == "checkpoint"],
            [e for e in events if e["event"] == "checkpoint_abandoned"])


def _after(job, out, ref, *, lost: int, path: str = "") -> None:
    """Recovered from step 4's save with ``lost`` gone: step 4's save abandoned while
    ``latest`` named step 2's, step 6's complete, no temp file left."""
    (rec,) = check_recovered(job, out, ref, lost=[[lost]], size=3)
    assert rec["step"] == 4, rec
    saved, (gone,) = _saves(out)
    assert saved == [2, 6], saved
    assert gone["step"] == 4 and gone["at_step"] == 4, gone
    assert gone["latest"] == "ckpt-00000002.h5", gone
    if path:
        assert gone["path"] == path, gone
    assert (out / "latest").read_text().strip() == "ckpt-00000006.h5"
    assert not (out / "ckpt-00000004.h5").exists()
    left = sorted(p.name for p in out.iterdir() if ".tmp-" in p.name)
    assert left == [], left


@pytest.mark.ft_smoke
def test_a_rank_lost_mid_write_of_a_blocking_save(ulfm, tmp_path, monkeypatch):
    ref = reference(tmp_path)
    monkeypatch.setenv("MPIDIST_CHECKPOINT_WRITER_HOOK", "point=mid-write,action=kill,rank=2,"
                                                         "step=4")
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2", extra=EVERY2)
    assert "rank 2" in job.err[2] and "kill at mid-write of step 4" in job.err[2], job.report()
    _after(job, out, ref, lost=2)


@pytest.mark.parametrize(("strategy", "rank", "point"), [
    ("zero1", 0, "before-write"), ("zero3", 3, "before-commit"), ("ddp", 1, "mid-write")])
def test_a_rank_lost_during_a_blocking_save(ulfm, tmp_path, monkeypatch, strategy, rank,
                                            point):
    ref = reference(tmp_path)
    monkeypatch.setenv("MPIDIST_CHECKPOINT_WRITER_HOOK",
                       f"point={point},action=kill,rank={rank},step=4")
    job, out = train(ulfm, tmp_path, monkeypatch, strategy=strategy, extra=EVERY2)
    _after(job, out, ref, lost=rank)


@pytest.mark.parametrize("strategy", ["zero2", "ddp"])
def test_a_rank_lost_in_an_asynchronous_write(ulfm, tmp_path, monkeypatch, strategy):
    """Rank 1 killed by its background writer, mid-write of step 4's save: the save in
    flight is abandoned on every survivor."""
    ref = reference(tmp_path)
    monkeypatch.setenv("MPIDIST_CHECKPOINT_WRITER_HOOK",
                       "point=mid-write,action=kill,rank=1,step=4")
    job, out = train(ulfm, tmp_path, monkeypatch, strategy=strategy,
                     extra=(*EVERY2, "--checkpoint-async"))
    _after(job, out, ref, lost=1, path="ckpt-00000004.h5")


def test_a_rank_lost_during_an_mpio_save_ends_the_job(ulfm, tmp_path, monkeypatch):
    """MPI-IO is not promised to survive a failure: one line, exit status 1, step 2's
    checkpoint still ``latest``; the restart continues the trajectory."""
    ref = reference(tmp_path)
    monkeypatch.setenv("MPIDIST_CHECKPOINT_IO", "mpio")
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2", extra=EVERY2,
                     kill=_kill(2, 4, "checkpoint:3"))
    assert not job.timed_out and job.returncode == 1, job.report()
    lines = [ln for ln in text(job).splitlines() if "mpidist train: error:" in ln]
    assert len(lines) == 1, job.report()
    assert "lost rank 2 during the checkpoint of step 4" in lines[0], lines
    assert "MPI-IO" in lines[0] and "latest is still ckpt-00000002.h5" in lines[0], lines
    assert (out / "latest").read_text().strip() == "ckpt-00000002.h5"
    assert not (out / "ckpt-00000004.h5").exists()
    again, _ = train(ulfm, tmp_path, monkeypatch, n=3, strategy="zero2", out=out,
                     extra=(*EVERY2, "--resume"))
    assert again.returncode == 0, again.report()
    rows = {r["step"]: r["loss"] for r in _rows(out / "metrics.jsonl") if r["split"] == "train"}
    assert sorted(rows) == sorted(ref)
    assert max(abs(rows[s] - ref[s]) for s in ref) <= 1e-9
