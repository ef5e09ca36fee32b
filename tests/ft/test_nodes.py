"""Several ranks lost together, on one host: where the holders of the copies are.

Rank ``r`` holds the copy of rank ``r - 1``. Ranks 1 and 3 lost in the same step (their
holders 2 and 0 alive) are recovered in the job on the single-process trajectory (float64,
1e-9); ranks 2 and 3 lost together (3 held 2's copy: the ranks of one node, when nodes
hold consecutive ranks) end the job in one line. A mesh that numbers the ranks node by
node where the launcher dealt them round-robin (``mpirun --map-by node``) is recovered by
mesh coordinates: the holder of a rank's copy is its neighbour in the mesh, not in the
launcher's numbering. Under a time limit. (Across real nodes: tests/cluster,
``test_in_job_recovery_across_nodes``.)
"""

from __future__ import annotations

from test_recovery import LIMIT, _kill, check_recovered, reference, text, train


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


def test_a_mesh_ordered_by_node_is_recovered_by_its_coordinates(ulfm, tmp_path, monkeypatch):
    """Mesh order 0, 2, 1, 3 (two nodes, round-robin): world rank 1 is mesh rank 2, whose
    copy mesh rank 3 (world rank 3) holds; counted in the launcher's order, rank 2 would
    be taken for its holder (the wrong trajectory)."""
    monkeypatch.setenv("MPIDIST_FT_KILL", _kill(1, 2, "backward"))
    job = ulfm("user_loop.py", 4, args=("2", "", "robin"), timeout=LIMIT)
    assert not job.timed_out and job.returncode == 0, job.report()
    for r in (0, 2, 3):
        start = job.last(r, "recovery")
        assert start["order"] == [0, 2, 1, 3] and start["status"].startswith("on ("), start
        got = job.last(r, "losses")
        assert got is not None, job.report()
        assert got["maxdiff"] <= 1e-9, got
        assert got["changes"] == [{"step": 1, "dead": [1], "size": 3}], got
