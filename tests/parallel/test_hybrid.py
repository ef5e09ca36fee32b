"""3D parallelism reproduces single-process training at every factorisation of the world."""

from __future__ import annotations

import numpy as np
import pytest
from strategy_helpers import reference_run

from mpidist.core import collectives as C
from mpidist.core.mesh import ProcessMesh
from mpidist.data import TextCorpus
from mpidist.nn import GPT, MLP, CrossEntropyLoss, GPTConfig, MSELoss
from mpidist.optim import AdamW
from mpidist.parallel import DDPOptimizer, HybridShardedOptimizer, ShardingConfiguration

# n_head, n_embd and the vocabulary divide by 2 and 4; n_layer=2 gives 4 units.
CONFIG = GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=4, n_embd=16)
B = 48  # divisible by dp in {1, 2, 3, 4} times 4 micro-batches
MICRO = 4
STEPS = 10
TOL = dict(rtol=1e-9, atol=1e-12)
_DATA: list[TextCorpus] = []


def world_size() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def factorizations(n: int) -> list[tuple[int, int, int]]:
    """Every (pp, dp, tp) with pp*dp*tp == n that the test GPT admits (tp | 4, pp <= 4)."""
    return [(pp, dp, n // (pp * dp)) for pp in range(1, n + 1) for dp in range(1, n + 1)
            if n % (pp * dp) == 0 and pp <= 4 and 4 % (n // (pp * dp)) == 0]


def data() -> TextCorpus:
    if not _DATA:
        _DATA.append(TextCorpus(CONFIG.block_size))
    return _DATA[0]


def make_opt() -> AdamW:
    return AdamW(lr=3e-3, weight_decay=0.1)


def reference(steps: int, clip: float | None):
    """Single-process training of the same GPT on the whole global batch."""
    return reference_run("gpt", steps, B, "float64", clip, gpt=CONFIG)


def hybrid(comm, sizes, *, zero=0, schedule="1f1b", clip=None, mesh=None):
    pp, dp, tp = sizes
    config = ShardingConfiguration(mesh=mesh, dtype="float64", micro_batches=MICRO,
                                   max_grad_norm=clip, bucket_mb=0.002)
    return HybridShardedOptimizer(make_opt(), config, pipeline_parallel_size=pp,
                                  tensor_parallel_size=tp, data_parallel_size=dp,
                                  zero_stage=zero, schedule=schedule, comm=comm)


def replicated_identical_over_tp(model) -> None:
    """tp-replicated parameters (LayerNorm, row-parallel biases, wpe) are bit-identical on
    every tp rank."""
    if model.tp_size == 1:
        return
    full = model.gather_state(model.param_shard) if model.shards_params else model.params
    views = model.layout.full_views(full)
    place = model.placement
    names = [n for n in place.stage_names[model.stage] if n not in place.partitions]
    mine = np.concatenate([views[n].reshape(-1) for n in names])
    every = C.allgather(mine, comm=model.tp_comm).reshape(model.tp_size, -1)
    assert (every == every[0]).all(), "tp-replicated parameters diverged"


SIZES = factorizations(world_size())
# (schedule, zero_stage, max_grad_norm): every schedule, with and without ZeRO over dp,
# with and without clipping by the global norm.
OPTIONS = [("gpipe", 0, None), ("1f1b", 0, 0.5), ("1f1b", 1, None), ("gpipe", 2, 0.5),
           ("1f1b", 3, 0.5), ("zero-bubble", 0, None), ("zero-bubble", 1, 0.5),
           ("zero-bubble", 2, None), ("zero-bubble", 3, 0.5)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: "pp{}-dp{}-tp{}".format(*s))
@pytest.mark.parametrize("schedule,zero,clip", OPTIONS)
def test_matches_single_process(comm, sizes, schedule, zero, clip):
    ref_losses, ref_params = reference(STEPS, clip)
    opt = hybrid(comm, sizes, zero=zero, schedule=schedule, clip=clip)
    model = opt.wrap(GPT(CONFIG), seed=0)
    result = opt.optimize(model, data(), STEPS, global_batch_size=B,
                          callback=lambda s, l: replicated_identical_over_tp(model))
    np.testing.assert_allclose(result.losses, ref_losses, **TOL)
    got = model.full_parameters()
    assert list(got) == list(ref_params)
    for name, ref in ref_params.items():
        np.testing.assert_allclose(got[name], ref, **TOL, err_msg=name)
    report = opt.memory_report()
    assert report["parameters"] > 0 and report["total"] >= report["parameters"]
    if sizes[0] > 1:
        stats = model.last_pipeline_stats
        # zero-bubble holds a micro-batch until its W: up to 1F1B's peak, p, on any stage
        limit = {"gpipe": MICRO, "zero-bubble": min(sizes[0], MICRO)}.get(
            schedule, sizes[0] - model.stage)
        assert stats.peak_live == limit
    model.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
@pytest.mark.parametrize("micro", [1, 3])
def test_every_schedule_with_fewer_or_odd_micro_batches(comm, schedule, micro):
    """pp = the world (2, 3 or 4 stages) with m < p or m not a multiple of p."""
    n = comm.Get_size()
    ref_losses, ref_params = reference(STEPS, None)
    config = ShardingConfiguration(dtype="float64", micro_batches=micro)
    opt = HybridShardedOptimizer(make_opt(), config, pipeline_parallel_size=n,
                                 data_parallel_size=1, schedule=schedule, comm=comm)
    model = opt.wrap(GPT(CONFIG), seed=0)
    result = opt.optimize(model, data(), STEPS, global_batch_size=B)
    np.testing.assert_allclose(result.losses, ref_losses, **TOL)
    got = model.full_parameters()
    for name, ref in ref_params.items():
        np.testing.assert_allclose(got[name], ref, **TOL, err_msg=name)
    model.free()


def _source_and_target(n: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    sizes = factorizations(n)
    src = next(s for s in sizes if s[0] > 1 and s[2] > 1) if n == 4 else \
        next(s for s in sizes if s[0] > 1)
    dst = next(s for s in sizes if s != src and s[1] > 1) if n > 2 else (1, 1, 2)
    return src, dst


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("target", ["ddp", "hybrid"])
def test_state_dict_moves_between_meshes(comm, target):
    """A hybrid state dict loaded into DDP or another mesh continues the same trajectory."""
    src, dst = _source_and_target(comm.Get_size())
    ref_losses, ref_params = reference(8, None)
    first = hybrid(comm, src, zero=1)
    m1 = first.wrap(GPT(CONFIG), seed=0)
    r1 = first.optimize(m1, data(), 4, global_batch_size=B)
    state = first.state_dict()
    m1.free()
    if target == "ddp":
        second = DDPOptimizer(make_opt(), ShardingConfiguration(dtype="float64",
                                                                micro_batches=2))
    else:
        second = hybrid(comm, dst, zero=2, schedule="zero-bubble")
    m2 = second.wrap(GPT(CONFIG), seed=5)  # a different init: must be overwritten
    second.load_state_dict(state)
    r2 = second.optimize(m2, data(), 4, global_batch_size=B)
    np.testing.assert_allclose(r1.losses + r2.losses, ref_losses, **TOL)
    got = m2.full_parameters()
    for name, ref in ref_params.items():
        np.testing.assert_allclose(got[name], ref, **TOL, err_msg=name)
    if target == "hybrid":
        # ... and back: DDP-shaped global tensors load into a hybrid model too.
        back = DDPOptimizer(make_opt(), ShardingConfiguration(dtype="float64"))
        back.wrap(GPT(CONFIG), seed=9)
        back.load_state_dict(second.state_dict())
        d = back.state_dict()
        for name, ref in ref_params.items():
            np.testing.assert_allclose(d["params"][name], ref, **TOL, err_msg=name)
        m2.free()


@pytest.mark.mpi(min_size=2)
def test_serialize_round_trip(comm):
    src, _ = _source_and_target(comm.Get_size())
    ref_losses, _ = reference(6, None)
    opt = hybrid(comm, src)
    model = opt.wrap(GPT(CONFIG), seed=0)
    r1 = opt.optimize(model, data(), 3, global_batch_size=B)
    blob = opt.serialize()
    fresh = hybrid(comm, src, schedule="gpipe")
    m2 = fresh.wrap(GPT(CONFIG), seed=3)
    fresh.deserialize(blob)
    r2 = fresh.optimize(m2, data(), 3, global_batch_size=B)
    np.testing.assert_allclose(r1.losses + r2.losses, ref_losses, **TOL)
    model.free()
    m2.free()


@pytest.mark.mpi(min_size=2)
def test_bad_input_raises_on_every_rank(comm):
    n = comm.Get_size()
    cfg = ShardingConfiguration(dtype="float64")
    with pytest.raises(ValueError, match=f"does not equal the world size {n}"):
        HybridShardedOptimizer(make_opt(), cfg, pipeline_parallel_size=n + 1,
                               data_parallel_size=1, comm=comm)
    with pytest.raises(ValueError, match="zero_stage=4"):
        HybridShardedOptimizer(make_opt(), cfg, zero_stage=4, comm=comm)
    with pytest.raises(ValueError, match="schedule='interleaved' needs micro_batches a "
                                         f"multiple of pp={n}"):
        HybridShardedOptimizer(make_opt(), cfg.replace(micro_batches=n + 1),
                               pipeline_parallel_size=n, schedule="interleaved", comm=comm)
    with pytest.raises(ValueError, match="schedule='zb-v' is not one of"):
        HybridShardedOptimizer(make_opt(), cfg, schedule="zb-v", comm=comm)
    mesh = ProcessMesh(comm, pp=n)
    with pytest.raises(ValueError, match="do not match config.mesh"):
        HybridShardedOptimizer(make_opt(), cfg.replace(mesh=mesh), tensor_parallel_size=n,
                               comm=comm)
    mesh.free()
    # tp does not divide n_head (5), the vocabulary (257) or n_embd (a tp of 3 on 16)
    tp_opt = HybridShardedOptimizer(make_opt(), cfg, tensor_parallel_size=n, comm=comm)
    with pytest.raises(ValueError, match=f"tp={n} does not divide n_head=5"):
        tp_opt.wrap(GPT(GPTConfig(n_head=5, n_embd=20)))
    with pytest.raises(ValueError, match=f"tp={n} does not divide vocab_size=257"):
        tp_opt.wrap(GPT(GPTConfig(vocab_size=257, n_head=12, n_embd=24)))
    with pytest.raises(ValueError, match="plan splits no layer of the MLP"):
        tp_opt.wrap(MLP([4, 4]))
    mse = HybridShardedOptimizer(make_opt(), cfg, tensor_parallel_size=n, comm=comm,
                                 loss=MSELoss())
    # (at a tp CONFIG's sizes do not divide, that comes first)
    with pytest.raises(ValueError, match="needs CrossEntropyLoss" if 4 % n == 0
                       else f"tp={n} does not divide"):
        mse.wrap(GPT(CONFIG))
    pp_opt = HybridShardedOptimizer(make_opt(), cfg, pipeline_parallel_size=n, comm=comm)
    with pytest.raises(ValueError, match=f"pp={n} is larger than the number of units"):
        pp_opt.wrap(MLP([3, 2]))
    with pytest.raises(ValueError, match="tie_weights"):
        pp_opt.wrap(GPT(GPTConfig(tie_weights=True, n_layer=2)))
    # fewer samples than micro-batches: raised on every rank before the pipeline runs
    m_opt = HybridShardedOptimizer(make_opt(), cfg.replace(micro_batches=2),
                                   pipeline_parallel_size=n, comm=comm)
    model = m_opt.wrap(GPT(CONFIG))
    x, y = data().batch(np.arange(1))
    with pytest.raises(ValueError, match="data-parallel rank 0 has a local batch of 1 samples, "
                                         "fewer than micro_batches=2"):
        m_opt.step(model, (x, y))
    model.free()


@pytest.mark.mpi(min_size=2)
def test_tied_weights_with_tensor_parallelism(comm):
    """tie_weights works with tp (the head shares the vocab-parallel embedding) at pp=1."""
    n = comm.Get_size()
    if 4 % n:
        pytest.skip("tp must divide the test GPT's sizes")
    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=4, n_embd=16,
                    tie_weights=True)
    ref = GPT(cfg)
    params, grads = ref.build(np.float64, seed=0)
    opt, loss = make_opt(), CrossEntropyLoss()
    state = opt.init_state(params.data.shape[0], dtype=np.float64)
    x, y = data().batch(np.arange(8))
    losses = []
    for _ in range(3):
        grads.zero_()
        losses.append(loss.forward(ref.forward(x), y))
        ref.backward(loss.backward())
        opt.update(params.data, grads.data, state)
    h = HybridShardedOptimizer(make_opt(), ShardingConfiguration(dtype="float64"),
                               tensor_parallel_size=n, comm=comm)
    model = h.wrap(GPT(cfg), seed=0)
    got = [h.step(model, (x, y)) for _ in range(3)]
    np.testing.assert_allclose(got, losses, **TOL)
    full = model.full_parameters()
    for name, v in params.views().items():
        np.testing.assert_allclose(full[name], v, **TOL, err_msg=name)
    model.free()
