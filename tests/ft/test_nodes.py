"""A node's ranks lost together, on one host: where the holders of the copies live.

Rank ``r`` holds the copy of rank ``r - 1``. Under round-robin placement (``mpirun
--map-by node``) on two nodes of two ranks, node 1 has ranks 1 and 3, whose holders (2
and 0) are on node 0: losing node 1 is recovered in the job. Under placement by node
(ranks 0, 1 on node 0; 2, 3 on node 1) rank 3 holds rank 2's copy: losing node 1 loses a
rank and its holder together, which ends the job in one line. Both are checked here with
the ranks of the would-be node killed in the same step (float64, 1e-9 against the
single-process run), under a time limit.
"""

from __future__ import annotations

from test_recovery import _kill, check_recovered, reference, text, train


def test_a_round_robin_node_lost_is_recovered(ulfm, tmp_path, monkeypatch):
    ref = reference(tmp_path)
    job, out = train(ulfm, tmp_path, monkeypatch, strategy="zero2",
                     kill=_kill(1, 4, "backward") + ";" + _kill(3, 4, "backward"))
    check_recovered(job, out, ref, lost=[[1, 3]], size=2)


def test_a_node_of_consecutive_ranks_lost_ends_the_job(ulfm, tmp_path, monkeypatch):
    job, _ = train(ulfm, tmp_path, monkeypatch, strategy="zero2",
                   kill=_kill(2, 4, "backward") + ";" + _kill(3, 4, "backward"))
    assert not job.timed_out and job.returncode == 1, job.report()
    lines = [ln for ln in text(job).splitlines() if "mpidist train: error:" in ln]
    assert len(lines) == 1, job.report()
    assert "rank 2 and rank 3, which held its copy, died together" in lines[0], lines
