"""Combinations the composable strategies make possible: gradient compression at every
sharding level, Local SGD over sharded replicas, and the clear errors for pairs that do
not go together."""

from __future__ import annotations

import numpy as np
import pytest
from strategy_helpers import make_case

from mpidist.core.mesh import ProcessMesh
from mpidist.data import GlobalBatchSampler
from mpidist.parallel import (
    STRATEGIES,
    AsyncSGD,
    GradientCompressionOptimizer,
    LocalSGD,
    LocalSGDOptimizer,
    ShardedOptimizer,
    ShardingConfiguration,
)
from mpidist.parallel.placement import LEVEL_NAMES

EXACT = {"rtol": 1e-12, "atol": 1e-14}
CLOSE = {"rtol": 1e-10, "atol": 1e-12}


def _train(comm, factory, kind: str, steps: int, batch: int):
    make_model, data, loss, make_opt = make_case(kind)
    config = ShardingConfiguration(mesh=ProcessMesh(comm), dtype="float64", bucket_mb=0.002)
    opt = factory(make_opt(), config, loss)
    model = opt.wrap(make_model(), seed=0)
    result = opt.optimize(model, data, steps, global_batch_size=batch)
    return np.array(result.losses), model.full_parameters(), opt


# -- compression at every level -------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("level", [1, 2, 3])
def test_uncompressed_hook_is_the_level_itself(comm, level):
    """method="none" is an allreduce of each piece: at level k it is ZeRO-k exactly."""
    ref, ref_p, _ = _train(comm, lambda b, c, l: STRATEGIES[LEVEL_NAMES[level]](b, c, loss=l),
                           "gpt", 4, 12)
    got, got_p, opt = _train(comm, lambda b, c, l: GradientCompressionOptimizer(
        b, c, method="none", zero_stage=level, loss=l), "gpt", 4, 12)
    np.testing.assert_allclose(got, ref, **EXACT)
    for name in ref_p:
        np.testing.assert_allclose(got_p[name], ref_p[name], **EXACT)
    assert opt.strategy == f"compression-none+{LEVEL_NAMES[level]}"
    assert opt.bytes_sent > 0


@pytest.mark.mpi(min_size=2)
def test_topk_keeping_everything_over_zero2_is_zero2(comm):
    """Top-k with ratio 1 sends every entry (no residual left): ZeRO-2's step, each unit's
    sum taken in rank order instead of MPI's."""
    ref, ref_p, _ = _train(comm, lambda b, c, l: STRATEGIES["zero2"](b, c, loss=l), "mlp", 6, 24)
    got, got_p, opt = _train(comm, lambda b, c, l: GradientCompressionOptimizer(
        b, c, method="topk", ratio=1.0, zero_stage=2, loss=l), "mlp", 6, 24)
    np.testing.assert_allclose(got, ref, **CLOSE)
    for name in ref_p:
        np.testing.assert_allclose(got_p[name], ref_p[name], **CLOSE)
    assert all(not np.any(r) for r in opt.hook.rank_state_arrays())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("method,margin", [("fp16", 1e-3), ("bf16", 1e-2), ("powersgd", 0.05),
                                           ("topk", 0.2)])
def test_compression_over_zero2_converges_like_zero2(comm, method, margin):
    """The codecs over ZeRO-2's unit pieces: losses within the margins measured for them
    over DDP's buckets; 16-bit methods send about half the bytes of a float32 exchange."""
    steps = 12
    ref, _, _ = _train(comm, lambda b, c, l: STRATEGIES["zero2"](b, c, loss=l), "gpt", steps, 12)
    got, _, opt = _train(comm, lambda b, c, l: GradientCompressionOptimizer(
        b, c, method=method, ratio=0.1, zero_stage=2, loss=l), "gpt", steps, 12)
    assert abs(got[-1] - ref[-1]) <= margin * ref[-1]
    assert opt.compression_ratio < (0.3 if method in ("fp16", "bf16") else 1.0)


# -- Local SGD over sharded replicas ---------------------------------------------------------
def local_sgd_reference(kind: str, steps: int, batch: int, replicas: int, group: int,
                        period: int):
    """Single-process Local SGD: each replica trains on the samples of its ``group`` dp
    ranks (its batch's mean gradient), and every ``period`` steps the replicas' parameters
    are averaged, weighted by their share of the global batch. Returns the global losses
    and the parameters after the last step."""
    make_model, data, loss, make_opt = make_case(kind)
    sampler = GlobalBatchSampler(len(data), batch, seed=0)
    reps = []
    for _ in range(replicas):
        model = make_model()
        params, grads = model.build(np.dtype("float64"), seed=0)
        opt = make_opt()
        reps.append((model, params, grads, opt, opt.init_state(params.data.shape[0],
                                                                dtype=np.float64)))
    losses = []
    n = replicas * group
    for step in range(steps):
        total, shares = 0.0, []
        for r, (model, params, grads, opt, state) in enumerate(reps):
            idx = np.concatenate([sampler.local_indices(step, k, n)
                                  for k in range(r * group, (r + 1) * group)])
            x, y = data.batch(idx)
            grads.zero_()
            value = loss.forward(model.forward(x), y)
            model.backward(loss.backward())
            opt.update(params.data, grads.data, state)
            shares.append(len(idx) / batch)
            total += shares[-1] * value
        losses.append(total)
        if (step + 1) % period == 0:
            avg = sum(w * p.data for w, (_, p, _, _, _) in zip(shares, reps, strict=True))
            for _, p, _, _, _ in reps:
                p.data[:] = avg
    return np.array(losses), {n: v.copy() for n, v in reps[0][1].views().items()}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("level", [1, 2, 3])
def test_local_sgd_over_sharded_replicas_matches_the_maths(comm, level):
    """Replicas of 2 ranks (the whole world at an odd size) sharding their state, gradients
    and parameters: the losses and the averaged model of single-process Local SGD."""
    size = comm.Get_size()
    group = 2 if size % 2 == 0 else size
    period, steps = 3, 6
    ref, ref_p = local_sgd_reference("mlp", steps, 24, size // group, group, period)
    got, got_p, opt = _train(comm, lambda b, c, l: LocalSGDOptimizer(
        b, c, sync_every=period, zero_stage=level, shard_group=group, loss=l), "mlp", steps, 24)
    np.testing.assert_allclose(got, ref, **CLOSE)
    for name in ref_p:
        np.testing.assert_allclose(got_p[name], ref_p[name], **CLOSE)
    assert opt.averages == steps // period
    assert opt.strategy == f"local_sgd+{LEVEL_NAMES[level]}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("factory", ["localsgd-zero1", "compressed-zero2"])
def test_sharded_combinations_resume_exactly(comm, tmp_path_factory, factory):
    """The hooks' per-rank state (replicas, residuals) is checkpointed with the shards: a
    run saved mid-way and loaded into a fresh optimizer continues bit for bit."""
    size = comm.Get_size()
    group = 2 if size % 2 == 0 else size
    make = {
        "localsgd-zero1": lambda b, c, l: LocalSGDOptimizer(b, c, sync_every=4, zero_stage=1,
                                                            shard_group=group, loss=l),
        "compressed-zero2": lambda b, c, l: GradientCompressionOptimizer(
            b, c, method="topk", ratio=0.2, zero_stage=2, loss=l),
    }[factory]
    make_model, data, loss, make_opt = make_case("mlp")
    config = ShardingConfiguration(mesh=ProcessMesh(comm), dtype="float64", bucket_mb=0.002)
    path = comm.bcast(str(tmp_path_factory.mktemp("ckpt") / "ckpt.h5") if comm.rank == 0
                      else None)
    opt = make(make_opt(), config, loss)
    model = opt.wrap(make_model(), seed=0)
    opt.optimize(model, data, 3, global_batch_size=24)
    opt.save(path)
    tail = opt.optimize(model, data, 3, global_batch_size=24).losses
    fresh = make(make_opt(), config, loss)
    model2 = fresh.wrap(make_model(), seed=1)
    fresh.load(path)
    again = fresh.optimize(model2, data, 3, global_batch_size=24).losses
    np.testing.assert_array_equal(again, tail)


# -- pairs that do not go together: one clear line, before anything is built -----------------
def test_pairs_that_do_not_compose_say_why():
    from mpidist.optim import SGD

    with pytest.raises(ValueError, match="'async' works at sharding levels \\[0\\], not at "
                                         "level 1 .*whole copies"):
        ShardedOptimizer(SGD(), level=1, hook=AsyncSGD(1))
    with pytest.raises(ValueError, match="shard_group=1 leaves nothing to shard"):
        LocalSGDOptimizer(SGD(), zero_stage=2)
    with pytest.raises(ValueError, match="'reduce-scatter' works at sharding levels \\[2, 3\\]"):
        from mpidist.parallel import ReduceScatter

        ShardedOptimizer(SGD(), level=1, hook=ReduceScatter())
    with pytest.raises(ValueError, match="'localsgd' runs on a data-parallel mesh; got pp=2"):
        LocalSGD(2).check(0, 2, 1)
    with pytest.raises(ValueError, match="strategy 'ddp' takes no option sync_period=4"):
        STRATEGIES["ddp"](SGD(), sync_period=4)


class _Untouchable:
    """A communicator of 2 ranks that fails the test if it is used for anything but telling
    its size (a local query: anything else could communicate)."""

    def Get_size(self):  # noqa: N802 - mpi4py's name
        return 2

    def __getattr__(self, name):
        raise AssertionError(f"the communicator was used ({name}) before the refusal")


@pytest.mark.parametrize("name, options, match", [
    ("localsgd", {"zero_stage": 2}, "shard_group=1 leaves nothing to shard"),
    ("async", {"zero_stage": 1}, "'async' works at sharding levels \\[0\\]"),
    ("compressed", {"compression": "zip"}, "zip"),
])
def test_registry_refuses_a_pair_before_making_the_mesh(name, options, match):
    """A strategy and level that cannot run together are refused by the hook's pure check
    when the optimizer is built, before anything is communicated (its mesh, a collective,
    is made when the model is wrapped)."""
    with pytest.raises(ValueError, match=match):
        from mpidist.optim import SGD

        STRATEGIES[name](SGD(), comm=_Untouchable(), dp=2, **options)


# -- tensor parallelism by plan, through the strategies --------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("level", [0, 2])
def test_mlp_split_by_its_plan_matches_single_process(comm, level):
    """An MLP (no GPT) under tensor parallelism over the whole world, its layers split by
    the MLP's default plan (column, row, last layer replicated), at ZeRO level 0 and 2:
    single-process training on the same global batch."""
    from mpidist.data import synthetic_regression
    from mpidist.nn import MLP, MSELoss
    from mpidist.optim import AdamW
    from mpidist.parallel import HybridShardedOptimizer

    sizes, steps, batch = [6, 24, 12, 3], 3, 16
    data = synthetic_regression(64, 6, 3, seed=2)
    loss = MSELoss()
    ref = MLP(sizes)
    params, grads = ref.build(np.dtype("float64"), seed=0)
    opt = AdamW(lr=1e-2)
    state = opt.init_state(params.data.shape[0], dtype=np.float64)
    sampler = GlobalBatchSampler(len(data), batch, seed=0)
    ref_losses = []
    for step in range(steps):
        x, y = data.batch(sampler.global_indices(step))
        grads.zero_()
        ref_losses.append(loss.forward(ref.forward(x), y))
        ref.backward(loss.backward())
        opt.update(params.data, grads.data, state)
    hybrid = HybridShardedOptimizer(AdamW(lr=1e-2), ShardingConfiguration(dtype="float64"),
                                    tensor_parallel_size=comm.Get_size(), zero_stage=level,
                                    comm=comm, loss=MSELoss())
    model = hybrid.wrap(MLP(sizes), seed=0)
    got = hybrid.optimize(model, data, steps, global_batch_size=batch).losses
    np.testing.assert_allclose(got, ref_losses, **CLOSE)
    full = model.full_parameters()
    for name, value in params.views().items():
        np.testing.assert_allclose(full[name], value, **CLOSE)
