"""Pipeline schedules as orders, and the simulator that predicts their steps (pure)."""

from __future__ import annotations

import pytest

from mpidist.parallel.pipeline import schedule_order
from mpidist.parallel.schedules import orders, simulate

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


def test_the_runtime_1f1b_is_the_simulated_one():
    for p, m in CASES:
        sim = orders("1f1b", p, m)
        for s in range(p):
            assert [(k if k == "F" else "B", i) for k, i, _ in sim[s]] == \
                schedule_order("1f1b", s, p, m)


@pytest.mark.parametrize("p,m", CASES)
def test_gpipe_and_1f1b_take_the_theoretical_step(p, m):
    f, b, w = 1.0, 1.5, 0.5
    for schedule in ("gpipe", "1f1b"):
        sim = simulate(orders(schedule, p, m), f=f, b=b, w=w)
        assert sim.step == pytest.approx((m + p - 1) * (f + b + w))
        assert sim.bubble == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 6), (4, 4)])
def test_zero_bubble_takes_zb_h1s_step(p, m):
    """ZB-H1 with equal F, B and W: m(F+B+W) + (p-1)(F+B-W), i.e. 13/15 of 1F1B's step
    at p=2, m=4 (Qi et al. 2024)."""
    zb = simulate(orders("zero-bubble", p, m), f=1, b=1, w=1).step
    assert zb == pytest.approx(3 * m + (p - 1))
    one = simulate(orders("1f1b", p, m), f=1, b=1, w=1).step
    if (p, m) == (2, 4):
        assert zb / one == pytest.approx(13 / 15)


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
