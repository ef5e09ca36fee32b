"""Pipeline schedules, stage partitioning and the stage runner."""

from __future__ import annotations

import numpy as np
import pytest

from mpidist.nn import MLP, MSELoss
from mpidist.parallel.pipeline import PipelineStage, bubble_fraction, partition_units
from mpidist.parallel.schedules import orders, peak_in_flight


# -- pure ---------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (2, 4), (4, 3), (4, 8)])
def test_schedule_orders(schedule, p, m):
    for s, order in enumerate(orders(schedule, p, m)):
        ops = [(k, i) for k, i, _ in order]
        assert sorted(ops) == sorted([("F", i) for i in range(m)] + [("BW", i) for i in range(m)])
        assert [i for k, i in ops if k == "BW"] == list(range(m))  # backwards in order
        for i in range(m):
            assert ops.index(("F", i)) < ops.index(("BW", i))
        live = peak = 0
        for k, _ in ops:
            live += 1 if k == "F" else -1
            peak = max(peak, live)
        assert peak == (m if schedule == "gpipe" else min(p - s, m))
    assert peak_in_flight(schedule, p, m) == (m if schedule == "gpipe" else min(p, m))


def test_schedule_rejects_bad_names():
    with pytest.raises(ValueError, match="schedule='zb'"):
        orders("zb", 2, 2)


def test_partition_units():
    assert partition_units([1] * 4, 1) == [(0, 4)]
    assert partition_units([1] * 4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert partition_units([1] * 5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert partition_units([10, 1, 1, 1, 10], 3, "parameters") == [(0, 1), (1, 4), (4, 5)]
    assert partition_units([5, 5, 5, 5], 2, "parameters") == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="pp=5 is larger than the number of units"):
        partition_units([1] * 4, 5)
    with pytest.raises(ValueError, match="balance='memory'"):
        partition_units([1] * 4, 2, "memory")


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)


def test_single_stage_runs_without_mpi():
    model = MLP([3, 4, 2])
    params, grads = model.build(np.float64, seed=0)
    x = np.random.default_rng(0).standard_normal((6, 3))
    y = np.random.default_rng(1).standard_normal((6, 2))
    loss = MSELoss()
    want = loss.forward(model.forward(x), y)
    model.backward(loss.backward())
    g_ref = grads.data.copy()
    grads.zero_()
    stage = PipelineStage(model.forward, model.backward, loss=loss)
    got = stage.run([x[:3], x[3:]], [y[:3], y[3:]], normalizer=6)
    assert got == pytest.approx(want, rel=1e-13)
    np.testing.assert_allclose(grads.data, g_ref, rtol=1e-12, atol=1e-14)


# -- MPI ----------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_equal_the_whole_model(comm, schedule):
    """An MLP split one unit per rank gives the single-process loss and gradients."""
    p, s = comm.Get_size(), comm.Get_rank()
    model = MLP([5] + [6] * p)  # p units
    params, grads = model.build(np.float64, seed=0)
    m = 4
    x = np.random.default_rng(0).standard_normal((8, 5))
    y = np.random.default_rng(1).standard_normal((8, 6))
    loss = MSELoss()
    want = loss.forward(model.forward(x), y)
    model.backward(loss.backward())
    g_ref = {k: v.copy() for k, v in grads.views().items()}
    grads.zero_()
    unit = model.units[s]
    stage = PipelineStage(unit.forward, unit.backward, comm=comm, loss=loss)
    xs = [x[2 * i:2 * i + 2] for i in range(m)]
    ys = [y[2 * i:2 * i + 2] for i in range(m)]
    got = stage.run(xs, ys, schedule=schedule, normalizer=8)
    if s == p - 1:
        assert got == pytest.approx(want, rel=1e-13)
    else:
        assert got == 0.0
    for name in unit.parameter_names():
        np.testing.assert_allclose(grads.views()[name], g_ref[name], rtol=1e-12, atol=1e-14)
    assert stage.stats.peak_live == (m if schedule == "gpipe" else min(p - s, m))
    assert stage.stats.seconds >= stage.stats.wait_seconds >= 0
