"""The core of in-job recovery that needs no lost rank: the kill points' syntax, what counts
as a lost process, the hook installed only under MPI's fault tolerance, a process that
survived nothing leaving normally. The failures themselves: tests/ft (make test-ft)."""

from __future__ import annotations

import pytest

from mpidist.core import calls, failure
from mpidist.core.failure import (
    KILL_ENV,
    KillPoint,
    ProcessFailure,
    UnrecoverableFailure,
    is_failure,
    parse_kill_points,
)


def test_kill_points_parse():
    assert parse_kill_points("") == []
    assert parse_kill_points("rank=2,step=5,phase=backward") == [KillPoint(2, 5, "backward")]
    assert parse_kill_points(" rank=0, step=3 ; rank=1,step=4,phase=update,call=0 ") == [
        KillPoint(0, 3, "*", 1), KillPoint(1, 4, "update", 0)]
    assert parse_kill_points("rank=3,step=2,phase=recovery,call=4") == [
        KillPoint(3, 2, "recovery", 4)]


@pytest.mark.parametrize("bad", ["2:5:backward", "rank=2", "step=3", "rank=x,step=1",
                                 "rank=1,step=-1", "rank=1,step=2,call=0",
                                 "rank=1,step=2,when=now", "rank=1,rank=2,step=3"])
def test_bad_kill_points_name_the_value(bad):
    with pytest.raises(ValueError, match=f"{KILL_ENV}=.*is not rank=R,step=S") as info:
        parse_kill_points(bad)
    assert "\n" not in str(info.value)


class _MPIError(Exception):
    def __init__(self, cls: int) -> None:
        super().__init__(f"class {cls}")
        self.cls = cls

    def Get_error_class(self) -> int:  # noqa: N802 - mpi4py's name
        return self.cls


def test_what_counts_as_a_lost_process():
    from mpi4py import MPI

    for name in ("ERR_PROC_FAILED", "ERR_REVOKED"):
        if hasattr(MPI, name):
            assert is_failure(_MPIError(getattr(MPI, name)))
    assert not is_failure(_MPIError(MPI.ERR_TRUNCATE))
    assert not is_failure(ValueError("no"))
    assert is_failure(ProcessFailure("lost", step=3, phase="backward"))


def test_failures_carry_where_they_were_seen():
    lost = ProcessFailure("a rank was lost", comm="world.0", op="Allreduce", step=4,
                          phase="optimizer", error_class=75, detected=12.5)
    assert (lost.comm, lost.op, lost.step, lost.phase, lost.detected) == \
        ("world.0", "Allreduce", 4, "optimizer", 12.5)
    assert isinstance(lost, RuntimeError)
    assert UnrecoverableFailure.plain  # the command line prints its text alone


def test_the_hook_only_where_fault_tolerance_is_on(monkeypatch):
    from mpidist.core.ft import fault_tolerance

    monkeypatch.setenv(KILL_ENV, "rank=0,step=999999,phase=never")
    installed = failure.enable()
    assert installed == fault_tolerance().available
    assert (failure._REVOKER in calls.hooks()) == installed  # noqa: SLF001
    assert not failure.survived() and failure.job_comm() is None
    assert failure.leave_if_survived(7) == 7  # nothing survived: the status, no exit


def test_a_kill_point_fires_only_at_its_call(monkeypatch):
    killed = []
    points = [KillPoint(0, 2, "backward", 2), KillPoint(0, 3, "update", 0)]
    killer = failure._Killer(points, 0)  # noqa: SLF001
    monkeypatch.setattr(killer, "_kill", lambda p, what: killed.append((p, what)))

    def call(step, phase_):
        calls.set_step(step)
        with calls.phase(phase_):
            killer.enter(calls.Call("world", 0, "coll", "Allreduce", 1, "float64", -1))
            killer.context()

    call(1, "backward")
    call(2, "forward")
    call(2, "backward")
    assert killed == []
    call(2, "backward")
    assert [p for p, _ in killed] == [points[0]] and "call 2: Allreduce" in killed[0][1]
    call(3, "update")
    assert [p for p, _ in killed] == points
    calls.set_step(-1)


def test_key_values_take_known_keys_once():
    from mpidist.core.specs import key_values

    assert key_values(" a = 1 ,b=x", ("a", "b")) == {"a": "1", "b": "x"}
    for bad in ("a=1,a=2", "a", "c=1", "a=1,"):
        with pytest.raises(ValueError):
            key_values(bad, ("a", "b"))
