"""The timeline's recorder and clocks in one process: nothing recorded without a recorder,
calls, waits, phases and blocks as properly nested Chrome trace events, nonblocking calls on
tracks where none overlaps, the per-rank clock, the clock alignment's test offset."""

from __future__ import annotations

import time

import numpy as np
import pytest
from trace_checks import improperly_nested

from mpidist.core import calls, comms
from mpidist.core import timeline as T


def test_no_recorder_records_nothing_and_installs_no_hook():
    assert T.active() is None
    before = calls.hooks()
    with T.span("x", "compute", a=1) as s:
        pass
    assert s is None  # the shared no-op context
    T.record("y", "data", 0.0, 1.0)
    assert calls.hooks() == before


def test_calls_waits_phases_and_blocks_nest_on_their_tracks():
    comm = comms.traced(comms.mpi().COMM_SELF.Dup())
    rec = T.Recorder()
    rec.start()
    try:
        assert T.active() is rec and rec in calls.hooks()
        with comms.phase("forward"), T.span("forward unit 0", "unit", micro_batch=0):
            comm.Allreduce(comms.in_place(), np.ones(4))
            reqs = [comm.Iallreduce(comms.in_place(), np.ones(3)) for _ in range(3)]
            calls.wait_all(reqs)
        with comms.phase("backward"):
            req = comm.Ibarrier()
            time.sleep(0.001)
            req.Wait()
    finally:
        rec.stop()
        comm.Free()
    assert T.active() is None and rec not in calls.hooks()
    ev = rec.chrome(rank=2, pid=7, alignment=T.Alignment(base=rec.t_start))
    xs = [e for e in ev if e["ph"] == "X"]
    assert not improperly_nested(ev)
    names = {e["name"] for e in xs}
    assert {"forward", "backward", "forward unit 0", "Allreduce", "Iallreduce", "Ibarrier",
            "wait Iallreduce", "wait Ibarrier"} <= names
    main = {e["name"] for e in xs if e["tid"] == 2000}
    assert "Allreduce" in main and "Iallreduce" not in main  # nonblocking: own tracks
    flight = [e for e in xs if e["cat"] == "mpi-async"]
    assert {e["tid"] for e in flight} <= {2500, 2501, 2502} and len(flight) == 4
    allreduce = next(e for e in xs if e["name"] == "Allreduce")
    assert allreduce["args"]["bytes"] == 32 and allreduce["args"]["phase"] == "forward"
    assert all(e["pid"] == 7 and e["ts"] >= 0 for e in xs)
    threads = {e["tid"]: e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert threads[2000] == "rank 2" and {e["tid"] for e in xs} <= set(threads)


def test_assign_lanes_never_overlaps_on_a_lane():
    rng = np.random.default_rng(0)
    starts = np.sort(rng.uniform(0, 10, 200))
    spans = [(a, a + rng.uniform(0, 2)) for a in starts]
    lanes = T.assign_lanes(spans)
    for k in set(lanes):
        mine = [s for s, lane in zip(spans, lanes, strict=True) if lane == k]
        assert all(b[0] >= a[1] for a, b in zip(mine, mine[1:], strict=False))
    # as few lanes as the most intervals alive at once
    most = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert max(lanes) + 1 == most


def test_phase_clock_counts_blocked_main_thread_time_by_phase():
    clock = T.PhaseClock()
    comm = comms.traced(comms.mpi().COMM_SELF.Dup())
    comms.add_hook(clock)
    try:
        with comms.phase("optimizer"):
            comm.Barrier()
            req = comm.Ibarrier()
            time.sleep(0.02)  # overlapped: completes while "computing"
            req.Wait()
        with comms.phase("checkpoint"):
            time.sleep(0.003)
    finally:
        comms.remove_hook(clock)
        comm.Free()
    assert clock.wall["optimizer"] >= 0.02 and clock.wall["checkpoint"] >= 0.003
    # the blocking barrier and the wait, not the sleep the nonblocking barrier overlapped
    assert 0 < clock.blocked["optimizer"] < 0.01


def test_clock_offset_spec():
    assert T.clock_skew(1, "1:5.0,2:-3") == 5.0
    assert T.clock_skew(2, "1:5.0,2:-3") == -3.0
    assert T.clock_skew(0, "1:5.0") == 0.0
    assert T.clock_skew(0, "") == 0.0
    for bad in ("5.0", "x:1", "1:y", "-1:2"):
        with pytest.raises(ValueError, match="MPIDIST_TEST_CLOCK_OFFSET"):
            T.clock_skew(0, bad)


def test_alignment_maps_onto_the_reference_clock():
    a = T.Alignment(offset=-5.0, rtt=2e-5, skew=5.0, base=100.0)
    assert a.bound == 1e-5
    assert a.micros(100.5) == pytest.approx(5e5)


@pytest.mark.mpi(min_size=2)
def test_align_removes_an_injected_clock_offset_within_half_a_round_trip(monkeypatch):
    comm = comms.world()
    size, rank = comm.Get_size(), comm.Get_rank()
    # every rank but 0 reads a clock that is off by whole seconds (ranks on one host share
    # CLOCK_MONOTONIC, so the true offset is exactly minus the injected one)
    spec = ",".join(f"{r}:{(-1) ** r * (r + 3.25)}" for r in range(1, size))
    monkeypatch.setenv("MPIDIST_TEST_CLOCK_OFFSET", spec)
    a = T.align(comm)
    assert a.skew == (0.0 if rank == 0 else (-1) ** rank * (rank + 3.25))
    assert abs(a.offset + a.skew) <= a.bound + 1e-9
    assert a.bound < 0.05  # one host: a round trip of microseconds to milliseconds
    # the reference time of one moment agrees across ranks within the bounds
    comm.Barrier()
    now = np.array([time.monotonic() + a.skew + a.offset, a.bound])
    allv = np.zeros((size, 2))
    comm.Allgather(now, allv)
    spread = allv[:, 0].max() - allv[:, 0].min()
    assert spread < 2 * allv[:, 1].max() + 0.05  # (the barrier's own exit skew included)
    bases = np.zeros(size)
    comm.Allgather(np.array([a.base]), bases)
    assert np.all(bases == bases[0])
