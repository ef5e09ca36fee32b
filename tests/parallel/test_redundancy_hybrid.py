"""The copies of meshes with pipeline or tensor parallelism, on any MPI: after every step,
the ranks other than any one rank, with the copy its holder keeps, still hold the whole
model's parameters and optimizer state (gathered as named global tensors, as in-job
recovery gathers them: mpidist.parallel.regroup), equal to the state dict; the copies do
not change training. The recovery itself needs MPI's fault tolerance:
tests/ft/test_recovery_hybrid.py. The mesh choice and the coverage rule are pure: tested
without MPI."""

from __future__ import annotations

import numpy as np
import pytest
from strategy_helpers import reference_run, sampled_steps

from mpidist.data import TextCorpus
from mpidist.nn import GPT, CrossEntropyLoss, GPTConfig
from mpidist.optim import AdamW
from mpidist.parallel import HybridShardedOptimizer, ShardingConfiguration
from mpidist.parallel.recovery import off_reason
from mpidist.parallel.redundancy import checkpoint_names
from mpidist.parallel.regroup import (
    assemble,
    choose_mesh,
    gather_named,
    holder_map,
    uncovered,
)

CONFIG = GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=4, n_embd=16)
B, STEPS = 24, 3
MESHES = [((2, 1, 2), 0), ((2, 1, 2), 1), ((2, 2, 1), 0), ((2, 2, 1), 1), ((1, 2, 2), 1),
          ((1, 2, 2), 3)]


def _train(comm, sizes, zero, redundancy, check=None):
    pp, dp, tp = sizes
    config = ShardingConfiguration(dtype="float64", micro_batches=2)
    opt = HybridShardedOptimizer(AdamW(lr=3e-3, weight_decay=0.1), config,
                                 pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                 data_parallel_size=dp, zero_stage=zero, comm=comm,
                                 loss=CrossEntropyLoss())
    opt.redundancy_mode = redundancy
    model = opt.wrap(GPT(CONFIG), seed=0)
    data = TextCorpus(CONFIG.block_size)
    return opt, sampled_steps(opt, model, data, STEPS, B, check)


def _without(opt, dead: int, comm):
    """The named tensors the ranks other than ``dead`` hold (the holder speaking for it)."""
    red, model = opt.redundancy, opt.model
    me = comm.Get_rank()
    tag = opt.step_count + 1
    keys = sorted(opt.state.buffers)
    sources = []
    if me != dead:
        params, state, _, _ = red.own_at(model, opt.state, {}, tag)
        sources.append((red.own_manifest(), [params, *(state[k] for k in keys)]))
        cart = list(range(comm.Get_size()))  # COMM_WORLD is the mesh's order here
        if holder_map(model.pp_size, model.dp_size, model.tp_size, model.level,
                      cart).get(dead) == me:
            copy = red.copy_at(tag)
            assert copy is not None
            sources.append((red.peer_manifest, [copy[0], *(copy[1][k] for k in keys)]))
    meta, data, _ = gather_named(comm, sources, np.float64)
    shapes = model.tensor_shapes()
    names = checkpoint_names(shapes, keys)
    return assemble(names, list(shapes.values()) * (1 + len(keys)), meta, data)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize(("sizes", "zero"), MESHES)
def test_every_rank_is_covered_after_every_step(sizes, zero):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Split(0 if MPI.COMM_WORLD.Get_rank() < 4 else MPI.UNDEFINED)
    if comm == MPI.COMM_NULL:
        return

    def check(opt):
        full = opt.state_dict()
        assert off_reason(opt) in (None, "MPI's fault tolerance is off")
        for dead in range(4):
            got, missing = _without(opt, dead, comm)
            assert not missing, (dead, missing[:3])
            for n, a in full["params"].items():
                np.testing.assert_array_equal(got[f"params/{n}"], a)
            for k, d in full["state"].items():
                for n, a in d.items():
                    np.testing.assert_array_equal(got[f"optimizer/{k}/{n}"], a)

    opt, with_copies = _train(comm, sizes, zero, "buddy", check)
    red = opt.redundancy
    if sizes[1] == 1:  # the whole local state (params, 2 AdamW buffers, step) each step
        assert red.cross and red.bytes_per_step() == (3 * red.snap_params.size + 1) * 8
    _, without = _train(comm, sizes, zero, "none")
    np.testing.assert_array_equal(with_copies, without)
    ref, _ = reference_run("gpt", STEPS, B, "float64", gpt=CONFIG)
    np.testing.assert_allclose(with_copies, ref, rtol=0, atol=1e-9)
    comm.Free()


# -- pure -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("m", "pp", "tp", "want"), [
    (3, 2, 1, (2, 1, 1)), (4, 2, 1, (2, 1, 2)), (3, 1, 2, (1, 2, 1)), (7, 2, 2, (2, 2, 1)),
    (8, 2, 2, (2, 2, 2)), (3, 2, 2, (2, 1, 1)), (1, 2, 2, (1, 1, 1)), (3, 1, 1, (1, 1, 3)),
    (2, 1, 4, (1, 1, 2)), (3, 4, 2, (1, 2, 1)), (5, 4, 4, (4, 1, 1))])
def test_choose_mesh_keeps_pp_and_tp_where_the_survivors_allow(m, pp, tp, want):
    assert choose_mesh(m, pp, tp) == want
    p, t, d = want
    assert p * t * d <= m and pp % p == 0 and tp % t == 0


def test_choose_mesh_needs_a_survivor():
    with pytest.raises(ValueError, match="m=0"):
        choose_mesh(0, 2, 2)


def test_holders_are_in_another_column_or_the_columns_dp_group():
    # pp2 x tp2 (dp 1): the next mesh rank, always another (stage, tp) column
    assert holder_map(2, 1, 2, 0, [0, 1, 2, 3]) == {0: 1, 1: 2, 2: 3, 3: 0}
    # pp2 x dp2, ZeRO: the next dp index of the same stage; DDP: none (replicas)
    assert holder_map(2, 2, 1, 1, [0, 1, 2, 3]) == {0: 1, 1: 0, 2: 3, 3: 2}
    assert holder_map(2, 2, 1, 0, [0, 1, 2, 3]) == {}
    # tp2 x dp2 (ranks (dp, tp) = 0:(0,0) 1:(0,1) 2:(1,0) 3:(1,1)): same tp index
    assert holder_map(1, 2, 2, 2, [0, 1, 2, 3]) == {0: 2, 1: 3, 2: 0, 3: 1}
    # a mesh ordered by node (run rank i is mesh rank cart_of[i]): by coordinates
    assert holder_map(1, 4, 1, 1, [0, 2, 1, 3]) == {0: 2, 2: 1, 1: 3, 3: 0}


def test_uncovered_names_the_rank_whose_state_is_gone():
    kw = dict(pp=2, dp=1, tp=2, level=0, cart_of=[0, 1, 2, 3])
    rows = np.array([[5, 0, 6, 6, 5]] * 4)
    assert uncovered([2], [0, 1, 3], rows[:3], 6, **kw) is None
    assert uncovered([1, 2], [0, 3], rows[:2], 6, **kw) == (1, 2, "died")
    stale = np.array([[5, 0, 6, 5, 4]] * 3)
    assert uncovered([2], [0, 1, 3], stale, 6, **kw) == (2, 3, "stale")
    ddp = dict(pp=2, dp=2, tp=1, level=0, cart_of=[0, 1, 2, 3])
    assert uncovered([2], [0, 1, 3], rows[:3], 6, **ddp) is None
    assert uncovered([2, 3], [0, 1], rows[:2], 6, **ddp) == (2, -1, "died")
