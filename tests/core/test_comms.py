"""The traced communicators: identities that match across ranks, the registry, the hooks
(every call seen on entry and on completion, nonblocking calls when their request
completes, errors), and the between-steps agreement vector."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpidist.core import comms
from mpidist.run.preempt import AGREEMENT_SLOTS, StepAgreement


class Recorder:
    """A hook keeping what it saw."""

    def __init__(self) -> None:
        self.entered: list[comms.Call] = []
        self.exited: list[comms.Call] = []
        self.errors: list[tuple[comms.Call, BaseException]] = []

    def enter(self, call: comms.Call) -> None:
        self.entered.append(call)

    def exit(self, call: comms.Call) -> None:
        self.exited.append(call)

    def error(self, call: comms.Call, exc: BaseException) -> None:
        self.errors.append((call, exc))


@pytest.fixture
def rec():
    r = Recorder()
    comms.add_hook(r)
    try:
        yield r
    finally:
        comms.remove_hook(r)


def _ids(comm, objs):
    """Every rank's list of identities (as JSON strings) of ``objs``."""
    return comm.allgather(json.dumps([comms.comm_id(o) for o in objs]))


def test_world_is_traced_and_the_same_object():
    from mpi4py import MPI

    w = comms.world()
    assert isinstance(w, MPI.Intracomm) and w == MPI.COMM_WORLD
    assert comms.comm_id(w) == "world"
    assert comms.world(MPI.COMM_WORLD) is w and comms.traced(w) is w
    assert comms.traced(None) is None
    assert comms.info(w).members == list(range(w.Get_size()))


def test_calls_reach_the_hooks_in_order(rec):
    w = comms.world()
    d = comms.label(w.Dup(), "test")
    try:
        a = np.arange(5, dtype=np.float64)
        d.Allreduce(comms.in_place(), a)
        req = d.Iallreduce(comms.in_place(), a)
        assert req.__class__.__name__ == "TracedRequest"
        comms.wait_all([req])
        req2 = d.Ibarrier()
        req2.Wait()
        mine = [c for c in rec.entered if c.comm == comms.comm_id(d)]
        assert [c.op for c in mine] == ["Allreduce", "Iallreduce", "Ibarrier"]
        assert [c.seq for c in mine] == [0, 1, 2]
        assert mine[0].count == 5 and str(mine[0].dtype) == "float64"
        assert all(c.t_exit is not None and c.t_exit >= c.t_enter for c in mine)
        assert {id(c) for c in mine} <= {id(c) for c in rec.exited}
        assert comms.info(d).label == "test"
        assert comms.inside() == {}
    finally:
        d.Free()
    assert comms.comm_id(d) == "" and d not in comms.live()


def test_step_and_phase_are_recorded(rec):
    w = comms.world()
    d = w.Dup()
    try:
        comms.set_step(7)
        with comms.phase("backward"):
            d.Barrier()
        d.Barrier()
        calls = [c for c in rec.entered if c.comm == comms.comm_id(d)]
        assert (calls[0].step, calls[0].phase) == (7, "backward")
        assert (calls[1].step, calls[1].phase) == (7, "")
    finally:
        comms.set_step(-1)
        d.Free()


def test_an_mpi_error_reaches_the_error_hook(rec):
    from mpi4py import MPI

    w = comms.world()
    d = w.Dup()
    try:
        with pytest.raises(MPI.Exception):
            d.Send(np.zeros(1), dest=w.Get_size() + 5)  # an invalid rank
        call, exc = rec.errors[-1]
        assert call.op == "Send" and call.error == exc.Get_error_class() != 0
    finally:
        d.Free()


def test_a_hook_may_replace_the_error():
    from mpi4py import MPI

    class Replace:
        def error(self, call, exc):
            raise RuntimeError(f"replaced {call.op}")

    w = comms.world()
    d = w.Dup()
    h = Replace()
    comms.add_hook(h)
    try:
        with pytest.raises(RuntimeError, match="replaced Send"):
            d.Send(np.zeros(1), dest=w.Get_size() + 5)
    finally:
        comms.remove_hook(h)
        d.Free()
    assert MPI.Is_initialized()


def test_agreement_alone():
    a = StepAgreement()
    assert [n for n, _ in a.slots] == [n for n, _ in AGREEMENT_SLOTS]
    assert a.agree(None) == dict.fromkeys(a.agreed, 0)
    a.set("preempt", 15)
    a.set("commit", 3)
    assert a.agree(None)["preempt"] == 15 and a.agreed["commit"] == 3
    a.clear("commit")
    assert a.agree(None)["commit"] == 0
    with pytest.raises(ValueError, match="reduction 'sum'"):
        StepAgreement((("x", "sum"),))


@pytest.mark.mpi(min_size=2)
def test_identities_match_across_ranks():
    w = comms.world()
    r, n = w.Get_rank(), w.Get_size()
    d = w.Dup()
    s = w.Split(r % 2, r)
    cart = w.Create_cart([n])
    sub = cart.Sub([True])
    objs = [d, s, cart, sub]
    ids = _ids(w, objs)
    assert len(set(ids)) == 1, ids
    assert len(set(json.loads(ids[0]))) == 4
    # Create_group: only the members take part, and the others' counters do not move.
    members = [0, 1]
    group = w.Get_group().Incl(members)
    g = w.Create_group(group) if r in members else None
    group.Free()
    if g is not None:
        assert len(set(g.allgather(comms.comm_id(g)))) == 1
        assert comms.info(g).members == members
    after = w.Dup()
    assert len(set(w.allgather(comms.comm_id(after)))) == 1
    seqs = w.allgather(comms.info(w).coll_seq)
    assert len(set(seqs)) == 1, seqs
    for c in [*objs, after, *([g] if g is not None else [])]:
        c.Free()


@pytest.mark.mpi(min_size=2)
def test_a_users_communicator_is_named_by_its_members():
    from mpi4py import MPI

    raw = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.Get_rank() % 2, 0)
    t = comms.traced(raw)
    try:
        assert comms.traced(raw) is t  # wrapping again finds the same
        assert t == raw
        ids = t.allgather(comms.comm_id(t))
        assert len(set(ids)) == 1 and ids[0].startswith("ext")
    finally:
        raw.Free()


@pytest.mark.mpi(min_size=2)
def test_agreement_over_ranks():
    w = comms.world()
    r, n = w.Get_rank(), w.Get_size()
    a = StepAgreement()
    a.set("preempt", 10 if r == n - 1 else 0)
    a.set("commit", 5 + r)
    if r == 0:
        a.set("straggler", 99)
    got = a.agree(w)
    assert got == {"preempt": 10, "commit": 5, "commit_error": 0, "recovery": 0,
                   "straggler": 99}
    assert len(set(w.allgather(json.dumps(got)))) == 1
