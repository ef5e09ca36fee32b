"""Pipeline schedules as orders, and the simulator that predicts their steps (pure)."""

from __future__ import annotations

import pytest

from mpidist.parallel.schedules import orders, peak_in_flight, simulate, step_units

CASES = [(2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (3, 2)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
@pytest.mark.parametrize("p,m", CASES)
def test_every_operation_once_in_a_valid_order(schedule, p, m):
    for order in orders(schedule, p, m):
        seen = {}
        for pos, (kind, i, _) in enumerate(order):
            seen[(kind, i)] = pos
        assert len(seen) == len(order)
        for i in range(m):
            if ("BW", i) in seen:
                assert seen[("F", i)] < seen[("BW", i)]
            else:
                assert seen[("F", i)] < seen[("B", i)] < seen[("W", i)]
        assert len(order) == (2 if schedule != "zero-bubble" else 3) * m
    simulate(orders(schedule, p, m), f=1, b=1, w=1)  # no deadlock


@pytest.mark.parametrize("p,m", CASES)
def test_gpipe_and_1f1b_take_the_theoretical_step(p, m):
    f, b, w = 1.0, 1.5, 0.5
    for schedule in ("gpipe", "1f1b"):
        sim = simulate(orders(schedule, p, m), f=f, b=b, w=w)
        assert sim.step == pytest.approx((m + p - 1) * (f + b + w))
        assert sim.bubble == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 6), (4, 4), (3, 2), (4, 1), (8, 64)])
def test_zero_bubble_takes_zb_h1s_step(p, m):
    """ZB-H1 with equal F, B and W: m(F+B+W) + (p-1)(F+B-W), i.e. 13/15 of 1F1B's step
    at p=2, m=4 (Qi et al. 2024); for m < p the first B reaches stage 0 at 2p - 1 and 2m
    units remain there. step_units gives the same."""
    zb = simulate(orders("zero-bubble", p, m), f=1, b=1, w=1).step
    assert zb == pytest.approx(3 * m + (p - 1) if m >= p else 2 * m + 2 * p - 1)
    assert step_units("zero-bubble", p, m) == zb
    one = simulate(orders("1f1b", p, m), f=1, b=1, w=1).step
    if (p, m) == (2, 4):
        assert zb / one == pytest.approx(13 / 15)


def _held(order):
    """Most micro-batches whose F is done and whose W (or BW) is not."""
    live = peak = 0
    for kind, _, _ in order:
        live += {"F": 1, "B": 0}.get(kind, -1)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("p", range(2, 7))
def test_zero_bubble_holds_no_more_than_1f1b(p):
    """A pending W keeps nearly all a micro-batch's activations: counted from F to W, no
    stage holds more than min(p, m) (1F1B's peak, stage 0's), and the step is never above
    1F1B's, at the lower bound max(3m + p - 1, 2m + 2p - 1) of any order."""
    for m in range(1, 3 * p + 1):
        zb, one = orders("zero-bubble", p, m), orders("1f1b", p, m)
        assert max(_held(o) for o in zb) <= min(p, m) == max(_held(o) for o in one)
        assert peak_in_flight("zero-bubble", p, m) == max(_held(o) for o in zb)
        step = simulate(zb, f=1, b=1, w=1).step
        assert step <= simulate(one, f=1, b=1, w=1).step
        assert step == max(3 * m + p - 1, 2 * m + 2 * p - 1)
        for f, b, w in ((1.0, 1.5, 0.5), (1.0, 2.0, 1.0)):
            assert simulate(zb, f=f, b=b, w=w).step <= simulate(one, f=f, b=b, w=w).step


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (2, 6, 3), (4, 4, 4)])
def test_interleaving_divides_the_bubble_by_the_virtual_stages(p, m, v):
    f, b = 1.0, 2.0  # per stage; a chunk takes 1/v of it
    sim = simulate(orders("interleaved", p, m, v), f=f / v, b=b / v, w=0.0)
    warm = (p - 1) / v
    assert sim.bubble == pytest.approx(warm / (m + warm))


def test_messages_cost_time():
    free = simulate(orders("1f1b", 2, 4), f=1, b=1, w=0).step
    slow = simulate(orders("1f1b", 2, 4), f=1, b=1, w=0, comm=0.25).step
    # at least the first forward's and the last backward's crossing, at most one per
    # micro-batch each way
    assert free + 2 * 0.25 <= slow <= free + 2 * 4 * 0.25


def test_bad_schedules_say_why():
    with pytest.raises(ValueError, match="micro_batches a multiple of pp=2; got micro_batches=3"):
        orders("interleaved", 2, 3, 2)
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule 'interleaved'"):
        orders("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="not one of"):
        orders("zb-v", 2, 4)
    bad = orders("1f1b", 2, 2)
    bad[0] = [("BW", 0, 0)] + [op for op in bad[0] if op != ("BW", 0, 0)]
    with pytest.raises(ValueError, match="deadlock: stage 0 waits at \\('BW', 0, 0\\)"):
        simulate(bad, f=1, b=1, w=1)
