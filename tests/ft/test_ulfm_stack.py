"""The fault-tolerance stack itself (Open MPI 5 under ``--with-ft ulfm``, mpi4py's ULFM calls,
mpidist.core.ft's verdict): a rank SIGKILLed, the survivors revoke, shrink and go on, and
the job ends with status 0. Each job runs under a time limit (ulfm_harness)."""

from __future__ import annotations

import shutil

import pytest
from mpi4py import MPI

FAILED = {MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED, MPI.ERR_PROC_FAILED_PENDING}


def _timings(job, killed_at: float) -> str:
    rec = job.each("recovered")
    detect = [e["detected"] - killed_at for e in rec.values()]
    return (f"detect {max(detect) * 1e3:.0f} ms (slowest survivor), revoke "
            f"{max(e['revoke_s'] for e in rec.values()) * 1e6:.0f} us, shrink "
            f"{max(e['shrink_s'] for e in rec.values()) * 1e3:.1f} ms")


@pytest.mark.parametrize("how", [
    pytest.param("itself", marks=pytest.mark.ft_smoke),
    "outside",
])
def test_survivors_of_a_sigkill_shrink_and_go_on(ulfm, how):
    victim, at = 2, 20
    if how == "itself":
        job = ulfm("allreduce_shrink.py", 4, kill_at=(victim, f"allreduce-{at}"))
        killing = job.last(victim, "killing")
        killed_at = killing["t"] if killing else float("nan")
    else:
        job = ulfm("allreduce_shrink.py", 4, kill_on=(victim, "looping"))
        killed_at = job.killed.get(victim, float("nan"))
    assert not job.timed_out, job.report()
    assert job.returncode == 0, job.report()
    assert job.last(victim, "ft")["available"], job.report()
    rec = job.each("recovered")
    assert sorted(rec) == [0, 1, 3], job.report()
    assert {e["error_class"] for e in rec.values()} <= FAILED, job.report()
    agreed = {e["agreed"] for e in rec.values()}
    assert agreed == {min(e["done"] for e in rec.values())}, job.report()
    if how == "itself":  # iteration `at` cannot complete anywhere without the victim
        assert all(e["done"] <= at for e in rec.values()), job.report()
    for e in rec.values():
        assert e["dead"] == [victim] and e["size"] == 3, job.report()
        assert e["sums"] == [1.0 + 2.0 + 4.0] * 5, job.report()
        assert e["revoked_after"] and not e["shrunk_revoked"], job.report()
    print(f"{how}: done {sorted(e['done'] for e in rec.values())}, {_timings(job, killed_at)}")


def test_detection_on_under_ulfm_and_off_elsewhere(ulfm):
    on = ulfm("detect.py", 2)
    assert on.returncode == 0, on.report()
    verdicts = on.each("ft")
    assert sorted(verdicts) == [0, 1], on.report()
    for v in verdicts.values():
        assert v["available"] and v["reason"] == "", on.report()
        assert v["library"].startswith("Open MPI v5") and v["line"].startswith("on ("), v
    # the same Open MPI 5 without --with-ft's setting: off, and the line says how to turn it on
    off = ulfm("detect.py", 2, mpiexec_args=("--mca", "mpi_ft_enable", "false"))
    assert off.returncode == 0, off.report()
    for v in off.each("ft").values():
        assert not v["available"] and v["source"] == "MPI_T", v
        assert "--with-ft ulfm" in v["reason"] and v["line"] == f"off: {v['reason']}", v
    if shutil.which("mpiexec") is None:
        pytest.skip("no system mpiexec on PATH for the 'off' case")
    system = ulfm("detect.py", 2, stack="system")
    assert system.returncode == 0, system.report()
    for v in system.each("ft").values():
        assert not v["available"] and v["reason"], v
        if v["library"].startswith("Open MPI v4"):
            assert "has no fault tolerance" in v["reason"], v


def test_only_revoking_every_communicator_unblocks_ranks_elsewhere(ulfm):
    hold = 1.0
    job = ulfm("subcomm_revoke.py", 4, args=(str(hold),), kill_at=(3, "die"))
    assert not job.timed_out, job.report()
    assert job.returncode == 0, job.report()
    assert job.last(3, "killing") and not job.last(3, "survived-the-kill-point"), job.report()
    assert job.last(2, "detected")["error_class"] in FAILED, job.report()
    revoking_sub = job.last(2, "revoking-sub")["t"]
    for r in (0, 1):
        got = job.last(r, "unblocked")
        assert got is not None, job.report()
        # still blocked while only comm was revoked (and known to be: comm_revoked), out
        # of the Allreduce only after sub was revoked too
        assert got["t"] >= revoking_sub, job.report()
        assert got["error_class"] == MPI.ERR_REVOKED and got["comm_revoked"], got
    blocked = min(job.last(r, "unblocked")["t"] for r in (0, 1)) - job.last(2, "revoked-comm")["t"]
    print(f"blocked {blocked:.2f} s after the first revoke (held {hold} s)")
    for r in (0, 1, 2):
        got = job.last(r, "shrunk")
        assert (got["comm_size"], got["sub_size"]) == (3, 3), job.report()
        assert got["comm_sum"] == got["sub_sum"] == 1.0 + 2.0 + 3.0, job.report()


def test_what_recovery_can_rely_on(ulfm, tmp_path):
    path = tmp_path / "after-shrink.h5"
    job = ulfm("semantics.py", 4, args=(str(path),), kill_at=(3, "iallreduce"))
    assert not job.timed_out, job.report()
    assert job.returncode == 0, job.report()
    seen = job.each("semantics")
    assert sorted(seen) == [0, 1, 2], job.report()
    for s in seen.values():
        assert s["iallreduce"] in ("MPI_ERR_PROC_FAILED", "MPI_ERR_REVOKED"), s
        assert not s["revoked_before"] and s["revoked_after"], s
        assert s["agree_before_ack"] == "MPI_ERR_PROC_FAILED", s
        assert s["failed"] == [3] and s["agree_after_ack"] == 0b101, s
        assert s["barrier_on_revoked"] == "MPI_ERR_REVOKED", s
        assert not s["world_revoked"] and s["world_allreduce"] == "MPI_ERR_PROC_FAILED", s
        assert s["h5_rows"] == [0.0, 1.0, 2.0], s
    assert seen[0]["pending_before_revoke"] == "pending", seen[0]
    assert seen[0]["pending"] == "MPI_ERR_REVOKED", seen[0]
    print("revoke seen without MPI progress:",
          {r: s["revoked_seen_without_progress"] for r, s in seen.items() if r != 1},
          "with progress after (ms):",
          {r: round(s["saw_revoked_s"] * 1e3, 1) for r, s in seen.items() if r != 1})
