"""Several ranks lost together, on one host: where the holders of the copies are.

Rank ``r`` holds the copy of rank ``r - 1``. Ranks 1 and 3 lost in the same step (their
holders 2 and 0 alive) are recovered in the job on the single-process trajectory (float64,
1e-9); ranks 2 and 3 lost together (3 held 2's copy: the ranks of one node, when nodes
hold consecutive ranks) end the job in one line. Under a time limit. (Across real nodes:
tests/cluster, ``test_in_job_recovery_across_nodes``.)
"""

from __future__ import annotations

from test_recovery import _kill, check_recovered, reference, text, train


def test_two_ranks_whose_holders_survive_are_recovered(ulfm, tmp_path, monkeypatch):
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2",
                     kill=_kill(1, 4, "backward") + ";" + _kill(3, 4, "backward"))
    check_recovered(job, out, ref, lost=[[1, 3]], size=2)


def test_a_rank_and_its_holder_lost_in_one_step_end_the_job(ulfm, tmp_path, monkeypatch):
    job, _ = train(ulfm, tmp_path, monkeypatch, strategy="zero2",
                   kill=_kill(2, 4, "backward") + ";" + _kill(3, 4, "backward"))
    assert not job.timed_out and job.returncode == 1, job.report()
    lines = [ln for ln in text(job).splitlines() if "mpidist train: error:" in ln]
    assert len(lines) == 1, job.report()
    assert "rank 2 and rank 3, which held its copy, died together" in lines[0], lines
