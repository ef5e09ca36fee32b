"""FunctionalModel: any framework's loss-and-gradient function trained by mpidist strategies."""

from __future__ import annotations

import numpy as np
import pytest

from mpidist.core.mesh import ProcessMesh
from mpidist.optim import SGD
from mpidist.parallel import ShardingConfiguration
from mpidist.parallel.adapters import FunctionalModel, FunctionalOptimizer

B, D_IN, D_OUT, STEPS = 24, 5, 3, 5
LR, MOMENTUM = 0.1, 0.9


def init_params():
    rng = np.random.default_rng(7)
    return {"w": rng.normal(size=(D_IN, D_OUT)) * 0.3, "b": np.zeros(D_OUT)}


def loss_and_grad(params, batch):
    """Mean squared error of a linear model, mean over samples (hand-written NumPy)."""
    x, y = batch
    err = x @ params["w"] + params["b"] - y
    n = len(x)
    return float(np.sum(err * err) / n), {"w": 2 * x.T @ err / n, "b": 2 * err.sum(0) / n}


def data(step):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(B, D_IN))
    return x, x @ np.arange(D_IN * D_OUT).reshape(D_IN, D_OUT) / 10.0


def reference(steps=STEPS):
    """Plain NumPy SGD with momentum (torch semantics) on the whole global batch."""
    p = {k: v.copy() for k, v in init_params().items()}
    buf = {}
    losses = []
    for s in range(steps):
        loss, g = loss_and_grad(p, data(s))
        losses.append(loss)
        for k in p:
            buf[k] = g[k] if k not in buf else MOMENTUM * buf[k] + g[k]
            p[k] -= LR * buf[k]
    return np.array(losses), p


def run(comm, strategy, *, micro=1, reduction="mean", fn=loss_and_grad):
    config = ShardingConfiguration(mesh=ProcessMesh(comm), dtype="float64", micro_batches=micro)
    model = FunctionalModel(init_params(), fn, reduction=reduction)
    opt = FunctionalOptimizer(model, strategy, SGD(lr=LR, momentum=MOMENTUM), config)
    n, r = comm.Get_size(), comm.Get_rank()
    b = B // n
    losses = []
    for s in range(STEPS):
        x, y = data(s)
        losses.append(opt.step((x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])))
    return np.array(losses), opt


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
@pytest.mark.parametrize("micro", [1, 2])
def test_matches_single_process(comm, strategy, micro):
    ref_losses, ref_params = reference()
    losses, opt = run(comm, strategy, micro=micro)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12)
    for k, v in opt.full_parameters().items():
        np.testing.assert_allclose(v, ref_params[k], rtol=1e-12, atol=1e-14)
    opt.free()


def test_single_process_and_sum_reduction():
    from mpi4py import MPI

    ref_losses, ref_params = reference()
    losses, opt = run(MPI.COMM_SELF, "ddp")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12)

    def summed(params, batch):
        loss, g = loss_and_grad(params, batch)
        n = len(batch[0])
        return loss * n, {k: v * n for k, v in g.items()}

    losses_sum, opt_sum = run(MPI.COMM_SELF, "zero2", micro=3, reduction="sum", fn=summed)
    np.testing.assert_allclose(losses_sum, ref_losses, rtol=1e-12)
    for k, v in opt_sum.params.items():
        np.testing.assert_allclose(v, ref_params[k], rtol=1e-12, atol=1e-14)
    opt.free()
    opt_sum.free()


def test_params_are_read_only_views_of_the_flat_buffer():
    from mpi4py import MPI

    seen = {}

    def fn(params, batch):
        seen.update(params)
        return loss_and_grad(params, batch)

    config = ShardingConfiguration(mesh=ProcessMesh(MPI.COMM_SELF), dtype="float64")
    opt = FunctionalOptimizer(FunctionalModel(init_params(), fn), "ddp", SGD(lr=LR), config)
    opt.step(data(0))
    for v in seen.values():
        assert np.shares_memory(v, opt.model.params)
        assert not v.flags.writeable
    assert np.shares_memory(opt.params["w"], opt.model.params)
    opt.free()


def test_missing_gradient_is_zero_and_bad_gradients_are_named():
    from mpi4py import MPI

    config = ShardingConfiguration(mesh=ProcessMesh(MPI.COMM_SELF), dtype="float64")

    def only_w(params, batch):
        loss, g = loss_and_grad(params, batch)
        return loss, {"w": g["w"]}

    opt = FunctionalOptimizer(FunctionalModel(init_params(), only_w), "ddp", SGD(lr=LR), config)
    opt.step(data(0))
    np.testing.assert_array_equal(opt.params["b"], 0.0)

    def wrong_name(params, batch):
        return 0.0, {"v": np.zeros(3)}

    bad = FunctionalOptimizer(FunctionalModel(init_params(), wrong_name), "ddp", "sgd", config)
    with pytest.raises(ValueError, match="unknown parameter 'v'"):
        bad.step(data(0))

    def wrong_shape(params, batch):
        return 0.0, {"b": np.zeros(4)}

    bad = FunctionalOptimizer(FunctionalModel(init_params(), wrong_shape), "ddp", "sgd", config)
    with pytest.raises(ValueError, match=r"gradient 'b' has shape \(4,\)"):
        bad.step(data(0))


def test_constructor_errors():
    with pytest.raises(ValueError, match="not callable"):
        FunctionalModel(init_params(), 3)
    with pytest.raises(ValueError, match="reduction='avg'"):
        FunctionalModel(init_params(), loss_and_grad, reduction="avg")
    with pytest.raises(ValueError, match="dtype int64"):
        FunctionalModel({"w": np.zeros(3, dtype=np.int64)}, loss_and_grad)
    with pytest.raises(ValueError, match="empty"):
        FunctionalModel({}, loss_and_grad)
    with pytest.raises(ValueError, match="strategy='nope'"):
        FunctionalOptimizer(FunctionalModel(init_params(), loss_and_grad), "nope")
