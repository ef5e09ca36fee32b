"""Activation checkpointing (``recompute="blocks"``): each unit keeps only its input and
runs its forward again just before its backward — the same operations, so the same bits."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from strategy_helpers import GPT_CONFIG, make_case

from mpidist.core.mesh import ProcessMesh
from mpidist.nn import GPT, GPTConfig
from mpidist.parallel import STRATEGIES, HybridShardedOptimizer, ShardingConfiguration
from mpidist.parallel.placement import LEVEL_NAMES


def _run(comm, level: int, recompute: str, steps: int = 3, pp: int = 1,
         schedule: str = "1f1b"):
    _, data, loss, make_opt = make_case("gpt")
    config = ShardingConfiguration(dtype="float64", micro_batches=2, recompute=recompute)
    if pp > 1:
        opt = HybridShardedOptimizer(make_opt(), config, pipeline_parallel_size=pp,
                                     zero_stage=level, comm=comm, loss=loss,
                                     schedule=schedule,
                                     virtual_stages=2 if schedule == "interleaved" else None)
    else:
        opt = STRATEGIES[LEVEL_NAMES[level]](make_opt(), config.replace(
            mesh=ProcessMesh(comm)), loss=loss)
    model = opt.wrap(GPT(GPT_CONFIG), seed=0)
    losses = opt.optimize(model, data, steps, global_batch_size=8).losses
    return np.array(losses), model.full_parameters()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("level", [0, 2, 3])
def test_recompute_is_bitwise_the_same_training(comm, level):
    ref, ref_p = _run(comm, level, "none")
    got, got_p = _run(comm, level, "blocks")
    np.testing.assert_array_equal(got, ref)
    for name in ref_p:
        np.testing.assert_array_equal(got_p[name], ref_p[name])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("level,schedule", [(1, "1f1b"), (3, "zero-bubble"),
                                            (0, "interleaved")])
def test_recompute_through_the_pipeline(comm, level, schedule):
    if comm.Get_size() % 2:
        pytest.skip("pp=2 needs an even world")
    ref, _ = _run(comm, level, "none", pp=2, schedule=schedule)
    got, _ = _run(comm, level, "blocks", pp=2, schedule=schedule)
    np.testing.assert_array_equal(got, ref)


def _held_after_forward(recompute: str) -> tuple[int, int]:
    """Bytes allocated by the forwards of 4 micro-batches of a 4-block GPT (kept for
    backward), and the bytes of one unit input."""
    from mpi4py import MPI

    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=32)
    config = ShardingConfiguration(mesh=ProcessMesh(MPI.COMM_SELF), dtype="float64",
                                   recompute=recompute)
    opt = STRATEGIES["ddp"](make_case("gpt")[3](), config)
    model = opt.wrap(GPT(cfg), seed=0)
    x = np.random.default_rng(0).integers(0, 256, size=(4, 32))
    model.forward(x, ctx="warm")  # first calls allocate once (kernels, workspaces)
    model.clear_cache()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    outs = [model.forward(x, ctx=i) for i in range(4)]
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del outs
    model.clear_cache()
    return held, 4 * 32 * 32 * 8


def test_recompute_keeps_only_the_unit_inputs():
    """Without recompute a block keeps about a dozen activations of its width (and the
    attention scores); with it, each unit keeps only its input: (units - 1) inputs of
    batch x block x n_embd per micro-batch, the embedding's integer ids and the logits
    the last unit hands to the loss."""
    full, unit = _held_after_forward("none")
    kept, _ = _held_after_forward("blocks")
    logits = 4 * 32 * 256 * 8
    # per micro-batch: the embedding unit's input (ids, tiny), 5 unit inputs of the width
    formula = 4 * (5 * unit + logits + 4 * 32 * 8)
    assert abs(kept - formula) <= 0.02 * formula + 16_384  # measured: 1,716,624 / 1,708,032
    assert full > 4 * kept                                   # measured: 8,772,440 without


def test_recompute_with_dropout_is_refused():
    cfg = ShardingConfiguration(recompute="blocks")
    with pytest.raises(ValueError, match="dropout .*p > 0.* masks are drawn in sequence"):
        STRATEGIES["ddp"](make_case("gpt")[3](), cfg).wrap(
            GPT(GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=8,
                          dropout=0.1)))
    with pytest.raises(ValueError, match="recompute='all' must be one of"):
        ShardingConfiguration(recompute="all")
