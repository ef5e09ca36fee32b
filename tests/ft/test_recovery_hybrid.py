"""In-job recovery on meshes with pipeline or tensor parallelism (``mpidist train --strategy
hybrid``) on the ULFM stack: a rank of pp2 x dp2, tp2 x dp2 or pp2 x tp2 (dp 1) at 4 ranks is
SIGKILLed at a named phase; the 3 survivors choose the mesh they go on with (pp and tp kept:
2 ranks go on, the third is released and exits with the job), gather the state from their
snapshots and the copies, redo the step, and finish with the single-process losses (float64,
1e-9). Two ranks whose state is gone together end the job in one line. Every job runs under a
time limit (ulfm_harness)."""

from __future__ import annotations

import pytest
from test_recovery import check_recovered, reference, text, train

MESHES = {"pp2-dp2-zero1": ("--pp", "2", "--zero-stage", "1"),
          "pp2-dp2-ddp": ("--pp", "2"),
          "tp2-dp2-zero1": ("--tp", "2", "--zero-stage", "1"),
          "tp2-dp2-zero2": ("--tp", "2", "--zero-stage", "2"),
          "pp2-tp2": ("--pp", "2", "--tp", "2"),
          "pp2-tp2-zero1": ("--pp", "2", "--tp", "2", "--zero-stage", "1")}
SCHEDULES = {"pp2-dp2-interleaved": ("--pp", "2", "--schedule", "interleaved",
                                     "--virtual-stages", "2", "--micro-batches", "2"),
             "pp2-tp2-zero-bubble": ("--pp", "2", "--tp", "2", "--schedule", "zero-bubble")}
MESHES.update(SCHEDULES)
SMOKE = [("pp2-tp2", "backward")]
MATRIX = [(m, p) for m in MESHES for p in ("forward", "backward", "update:0", "agreement")
          if (m, p) not in SMOKE and m not in SCHEDULES] \
    + [(m, "backward") for m in SCHEDULES]


def _kill(rank: int, step: int, phase: str) -> str:
    name, _, call = phase.partition(":")
    return f"rank={rank},step={step},phase={name}" + (f",call={call}" if call else "")


def _run(ulfm, tmp_path, monkeypatch, mesh: str, kill: str):
    return train(ulfm, tmp_path, monkeypatch, strategy="hybrid", kill=kill,
                 extra=MESHES[mesh])


def _check(job, out, ref, lost: list[int]) -> None:
    (rec,) = check_recovered(job, out, ref, lost=[lost], size=2)
    assert rec["world_size"] == 2, rec
    # the released survivor trained no more and ended with the job (status 0)
    assert "2 rank(s) go on from step" in text(job), job.report()


@pytest.mark.ft_smoke
@pytest.mark.parametrize(("mesh", "phase"), SMOKE)
def test_a_lost_rank_of_a_hybrid_mesh_costs_nothing(ulfm, tmp_path, monkeypatch, mesh, phase):
    ref = reference(tmp_path)
    job, out = _run(ulfm, tmp_path, monkeypatch, mesh, _kill(2, 3, phase))
    assert job.last(2, "step-3") is not None and job.last(2, "step-4") is None, job.report()
    _check(job, out, ref, [2])


@pytest.mark.parametrize(("mesh", "phase"), MATRIX)
def test_every_mesh_and_phase(ulfm, tmp_path, monkeypatch, mesh, phase):
    ref = reference(tmp_path)
    job, out = _run(ulfm, tmp_path, monkeypatch, mesh, _kill(1, 4, phase))
    _check(job, out, ref, [1])


def test_rank_0_of_a_pipeline_killed(ulfm, tmp_path, monkeypatch):
    ref = reference(tmp_path)
    job, out = _run(ulfm, tmp_path, monkeypatch, "pp2-tp2", _kill(0, 3, "optimizer"))
    _check(job, out, ref, [0])
    assert "== mpidist train summary ==" in job.out[1], job.report()


def test_a_rank_and_the_holder_of_its_copy_killed_together(ulfm, tmp_path, monkeypatch):
    job, _ = _run(ulfm, tmp_path, monkeypatch, "pp2-tp2",
                  _kill(1, 3, "optimizer:0") + ";" + _kill(2, 3, "optimizer:0"))
    assert not job.timed_out and job.returncode == 1, job.report()
    lines = [ln for ln in text(job).splitlines() if "mpidist train: error:" in ln]
    assert len(lines) == 1, job.report()
    assert "rank 1 and rank 2, which held its copy, died together" in lines[0], lines


def test_two_recoveries_down_to_one_rank(ulfm, tmp_path, monkeypatch):
    """pp2 x tp2 loses rank 2 (pp2 x dp1 goes on, rank 3 released), then rank 1: the last
    rank trains alone (pp and tp dropped), on the single-process trajectory."""
    ref = reference(tmp_path)
    job, out = _run(ulfm, tmp_path, monkeypatch, "pp2-tp2",
                    _kill(2, 2, "backward") + ";" + _kill(1, 4, "forward"))
    check_recovered(job, out, ref, lost=[[2], [1]], size=1)
