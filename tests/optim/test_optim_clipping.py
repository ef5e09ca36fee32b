"""Clipping by the global gradient norm: local shards, and over MPI ranks."""

from __future__ import annotations

import math

import numpy as np
import pytest

import mpidist.optim as optim


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_clip_scale_over_local_shards(dtype):
    rng = np.random.default_rng(3)
    shards = [rng.standard_normal(n).astype(dtype) for n in (10, 0, 333)]
    norm = float(np.linalg.norm(np.concatenate(shards).astype(np.float64)))
    scale, total = optim.clip_scale(shards, 1.0)
    np.testing.assert_allclose(total, norm, rtol=1e-12)
    np.testing.assert_allclose(scale, 1.0 / (norm + 1e-6), rtol=1e-12)
    assert optim.clip_scale(shards, 1e6) == (1.0, total)
    assert optim.clip_scale(shards[2], 1e6)[1] == pytest.approx(
        float(np.linalg.norm(shards[2].astype(np.float64))), rel=1e-12
    )


def test_clip_scale_is_folded_into_the_update():
    g = np.array([3.0, 4.0])
    scale, total = optim.clip_scale(g, 1.0)
    assert total == 5.0
    p = np.zeros(2)
    opt = optim.SGD(lr=1.0)
    opt.update(p, g, opt.init_state(p), grad_scale=scale)
    np.testing.assert_allclose(np.linalg.norm(p), 1.0, rtol=1e-6)


def test_non_finite_norm_propagates():
    scale, total = optim.clip_scale(np.array([np.nan, 1.0]), 1.0)
    assert math.isnan(total) and math.isnan(scale)
    scale, total = optim.clip_scale(np.array([np.inf, 1.0]), 1.0)
    assert total == math.inf and scale == 0.0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), True, "1"])
def test_bad_max_norm(bad):
    with pytest.raises(ValueError, match="max_norm="):
        optim.clip_scale(np.ones(3), bad)


def test_clip_scale_with_a_size_one_communicator():
    mpi4py = pytest.importorskip("mpi4py")
    pytest.importorskip("mpidist.core.collectives")
    from mpi4py import MPI

    assert mpi4py
    g = np.array([3.0, 4.0])
    assert optim.clip_scale(g, 1.0, comm=MPI.COMM_SELF) == optim.clip_scale(g, 1.0)


@pytest.mark.mpi
def test_clip_scale_over_ranks(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    full = np.random.default_rng(11).standard_normal(101 * size)
    shard = full[rank * 101 : (rank + 1) * 101].copy()
    scale, total = optim.clip_scale([shard], 2.0, comm=comm)
    np.testing.assert_allclose(total, np.linalg.norm(full), rtol=1e-12)
    np.testing.assert_allclose(scale, 2.0 / (total + 1e-6), rtol=1e-14)
    # Every rank gets bit-identical values, so their updates stay consistent.
    assert comm.allgather((scale, total)) == [(scale, total)] * size
