"""Any world size: a global batch of 32 that does not divide into the data-parallel ranks
(3 ranks: 11 + 11 + 10) or micro-batches that do not divide a local batch are split into
slices that differ by at most one sample, and every strategy still reproduces single-process
training (float64, 1e-10). The communication-efficient strategies accept any size too."""

from __future__ import annotations

import numpy as np
import pytest
from strategy_helpers import make_case, reference_run

from mpidist.core.mesh import ProcessMesh
from mpidist.optim import SGD
from mpidist.parallel import (
    STRATEGIES,
    AsyncSGDOptimizer,
    DDPOptimizer,
    ElasticOptimizer,
    GradientCompressionOptimizer,
    HybridShardedOptimizer,
    LocalSGDOptimizer,
    ShardingConfiguration,
)
from mpidist.parallel.registry import DATA_PARALLEL

B = 32
STEPS = 5
TOL = dict(rtol=1e-10, atol=1e-12)


def world_size() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def uneven(n: int, micro: int) -> bool:
    """Whether some split is uneven: B over n ranks, or a local batch over micro."""
    sizes = [B // n + (r < B % n) for r in range(n)]
    return B % n != 0 or any(s % micro for s in sizes)


def check(result, model, ref) -> None:
    ref_losses, ref_params = ref
    np.testing.assert_allclose(result.losses, ref_losses, **TOL)
    got = model.full_parameters()
    assert sorted(got) == sorted(ref_params)
    for name, want in ref_params.items():
        np.testing.assert_allclose(got[name], want, **TOL, err_msg=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", DATA_PARALLEL)
@pytest.mark.parametrize("micro,clip", [(1, None), (3, 0.05)])
def test_data_parallel_strategies_match_single_process(comm, strategy, micro, clip):
    if not uneven(comm.Get_size(), micro):
        pytest.skip(f"B={B} splits evenly at {comm.Get_size()} ranks x {micro} micro-batches")
    make_model, data, loss, make_opt = make_case("gpt")
    config = ShardingConfiguration(mesh=ProcessMesh(comm), dtype="float64", micro_batches=micro,
                                   max_grad_norm=clip, bucket_mb=0.002)
    opt = STRATEGIES[strategy](make_opt(), config, loss=loss)
    model = opt.wrap(make_model(), seed=0)
    result = opt.optimize(model, data, STEPS, global_batch_size=B)
    check(result, model, reference_run("gpt", STEPS, B, "float64", max_grad_norm=clip))
    # validation on the same uneven split is the single-process mean too
    from mpi4py import MPI

    one = DDPOptimizer(make_opt(), ShardingConfiguration(mesh=ProcessMesh(MPI.COMM_SELF),
                                                         dtype="float64"), loss=loss)
    solo = one.wrap(make_model(), seed=0)
    solo.load_full_parameters(model.full_parameters())
    want = one.evaluate(solo, data, batches=2, global_batch_size=B, seed=5)
    got = opt.evaluate(model, data, batches=2, global_batch_size=B, seed=5)
    np.testing.assert_allclose(got, want, **TOL)


def hybrid_sizes(n: int) -> list[tuple[int, int, int]]:
    """(pp, dp, tp) with pp*dp*tp == n that the test GPT admits (tp | 2, pp <= 4)."""
    return [(pp, dp, n // (pp * dp)) for pp in range(1, 5) for dp in range(1, n + 1)
            if n % (pp * dp) == 0 and (n // (pp * dp)) in (1, 2)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero,schedule", [(0, "1f1b"), (3, "gpipe")])
def test_hybrid_matches_single_process_at_every_mesh(comm, zero, schedule):
    ref = reference_run("gpt", STEPS, B, "float64")
    make_model, data, loss, make_opt = make_case("gpt")
    for pp, dp, tp in hybrid_sizes(comm.Get_size()):
        config = ShardingConfiguration(dtype="float64", micro_batches=3, bucket_mb=0.002)
        opt = HybridShardedOptimizer(make_opt(), config, pipeline_parallel_size=pp,
                                     tensor_parallel_size=tp, data_parallel_size=dp,
                                     zero_stage=zero, schedule=schedule, comm=comm, loss=loss)
        model = opt.wrap(make_model(), seed=0)
        result = opt.optimize(model, data, STEPS, global_batch_size=B)
        check(result, model, ref)
        model.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_elastic_leave_keeps_the_trajectory_through_uneven_sizes(comm, strategy):
    """n workers, then the last one leaves after step 2: 2 -> 1, 3 -> 2, 4 -> 3 (11+11+10)."""
    make_model, data, loss, make_opt = make_case("gpt")
    opt = ElasticOptimizer(make_opt(), ShardingConfiguration(dtype="float64"), 1, 8,
                           strategy=strategy, comm=comm, loss=loss, handle_sigterm=False)
    model = opt.wrap(make_model(), seed=0)
    from mpidist.data import GlobalBatchSampler

    opt.sampler = GlobalBatchSampler(len(data), B, seed=0)
    last = comm.Get_size() - 1
    losses = []
    while opt.step_count < STEPS:
        idx = opt.sampler.next_local(model.dp_rank, model.dp_size)
        losses.append(opt.step(model, data.batch(idx)))
        if opt.step_count == 2 and comm.Get_rank() == last:
            opt.request_leave()
        model = opt.maybe_rescale(model)
        if model is None:
            break
    comm.Barrier()
    if model is None:
        assert comm.Get_rank() == last and len(losses) == 2
        return
    assert opt.current_workers == comm.Get_size() - 1
    ref_losses, ref_params = reference_run("gpt", STEPS, B, "float64")
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    got = model.full_parameters()
    for name, want in ref_params.items():
        np.testing.assert_allclose(got[name], want, **TOL, err_msg=name)
    opt.free()


# Exactly DDP at any split: Local SGD with H=1 and plain SGD (replicas weighted by their
# share of the batch), uncompressed exchange, async with staleness 0.
EXACT = {
    "local_sgd_H1": lambda b, c, l: LocalSGDOptimizer(b, c, sync_every=1, loss=l),
    "compression_none": lambda b, c, l: GradientCompressionOptimizer(b, c, method="none",
                                                                     loss=l),
    "async_s0": lambda b, c, l: AsyncSGDOptimizer(b, c, staleness=0, loss=l),
}
# The lossy ones run and keep their replicas identical (Local SGD after averaging).
LOSSY = {
    "local_sgd_H2": lambda b, c, l: LocalSGDOptimizer(b, c, sync_every=2, loss=l),
    "fp16": lambda b, c, l: GradientCompressionOptimizer(b, c, method="fp16", loss=l),
    "topk": lambda b, c, l: GradientCompressionOptimizer(b, c, method="topk", ratio=0.1,
                                                         loss=l),
    "powersgd": lambda b, c, l: GradientCompressionOptimizer(b, c, method="powersgd", rank=2,
                                                             loss=l),
    "async_s1": lambda b, c, l: AsyncSGDOptimizer(b, c, staleness=1, loss=l),
}


def _train(comm, factory, micro=1, steps=4):
    make_model, data, loss, _ = make_case("gpt")
    config = ShardingConfiguration(mesh=ProcessMesh(comm), dtype="float64", micro_batches=micro,
                                   bucket_mb=0.002)
    opt = factory(SGD(lr=0.5), config, loss)
    model = opt.wrap(make_model(), seed=0)
    return opt.optimize(model, data, steps, global_batch_size=B), opt, model


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("variant", sorted(EXACT))
def test_communication_efficient_exact_variants_equal_ddp(comm, variant):
    if not uneven(comm.Get_size(), 3):
        pytest.skip("the split is even")
    ref, _, ref_model = _train(comm, lambda b, c, l: DDPOptimizer(b, c, loss=l), micro=3)
    got, _, model = _train(comm, EXACT[variant], micro=3)
    np.testing.assert_allclose(got.losses, ref.losses, **TOL)
    np.testing.assert_allclose(model.params, ref_model.params, **TOL)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("variant", sorted(LOSSY))
def test_communication_efficient_lossy_variants_accept_any_size(comm, variant):
    from mpidist.core import collectives as C

    if B % comm.Get_size() == 0:
        pytest.skip("the split is even")
    result, opt, model = _train(comm, LOSSY[variant])
    if isinstance(opt, AsyncSGDOptimizer):
        opt.flush()
    assert result.steps == 4 and all(np.isfinite(result.losses))
    # the first loss (before any update) is the single-process loss of the global batch
    np.testing.assert_allclose(result.losses[0], reference_run("gpt", 1, B, "float64")[0][0],
                               **TOL)
    everyone = C.allgather(model.params, comm=model.comm).reshape(model.dp_size, -1)
    assert (everyone == everyone[0]).all(), "replicas diverged"
