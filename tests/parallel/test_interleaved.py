"""The interleaved schedule (v model chunks per stage) and every schedule with ZeRO over dp
reproduce single-process training; the clear errors; checkpoints resume across schedules."""

from __future__ import annotations

import numpy as np
import pytest
from strategy_helpers import reference_run

from mpidist.data import TextCorpus
from mpidist.nn import GPT, GPTConfig
from mpidist.optim import AdamW
from mpidist.parallel import HybridShardedOptimizer, ShardingConfiguration
from mpidist.parallel.schedules import orders

B = 24  # divisible by dp in {1, 2} times 2, 3 or 4 micro-batches
STEPS = 3
TOL = dict(rtol=1e-9, atol=1e-12)
_DATA: list[TextCorpus] = []


def gpt(n_layer: int) -> GPTConfig:
    """A tiny GPT of ``n_layer + 2`` units (embedding, blocks, head)."""
    return GPTConfig(vocab_size=256, block_size=8, n_layer=n_layer, n_head=2, n_embd=8)


def data() -> TextCorpus:
    if not _DATA:
        _DATA.append(TextCorpus(8))
    return _DATA[0]


def make_opt() -> AdamW:
    return AdamW(lr=3e-3, weight_decay=0.1)


def reference(n_layer: int, steps: int = STEPS) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Single-process training of the same GPT on the whole global batch."""
    return reference_run("gpt", steps, B, "float64", gpt=gpt(n_layer))


def hybrid(comm, pp: int, dp: int = 1, *, zero: int = 0, schedule: str = "interleaved",
           v: int | None = None, micro: int = 4) -> HybridShardedOptimizer:
    config = ShardingConfiguration(dtype="float64", micro_batches=micro, bucket_mb=0.0005)
    return HybridShardedOptimizer(make_opt(), config, pipeline_parallel_size=pp,
                                  data_parallel_size=dp, zero_stage=zero, schedule=schedule,
                                  virtual_stages=v, comm=comm)


def check_trains_like_one_process(comm, opt, n_layer: int) -> None:
    ref_losses, ref_params = reference(n_layer)
    model = opt.wrap(GPT(gpt(n_layer)), seed=0)
    result = opt.optimize(model, data(), STEPS, global_batch_size=B)
    np.testing.assert_allclose(result.losses, ref_losses, **TOL)
    got = model.full_parameters()
    assert list(got) == list(ref_params)
    for name, ref in ref_params.items():
        np.testing.assert_allclose(got[name], ref, **TOL, err_msg=name)
    if model.pp_size > 1:
        v = len(model.chunks)
        order = orders(opt.schedule, model.pp_size, opt.config.micro_batches, v)[model.stage]
        live = peak = 0
        for kind, _, _ in order:
            live += {"F": 1, "B": 0, "BW": -1, "W": -1}[kind]  # held from F to W
            peak = max(peak, live)
        assert model.last_pipeline_stats.peak_live == peak
    model.free()


# (virtual stages, layers) at pp = the world: 2 chunks per stage, and 3 where units allow
CHUNKS = {2: [(2, 2), (3, 4)], 3: [(2, 4)], 4: [(2, 6)]}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", [0, 1])
def test_interleaved_matches_single_process(comm, case):
    """pp = the world (2, 3 or 4 stages), ZeRO 0, v chunks per stage, m a multiple of p."""
    n = comm.Get_size()
    if case >= len(CHUNKS.get(n, [])):
        pytest.skip(f"no case {case} at pp={n}")
    v, n_layer = CHUNKS[n][case]
    micro = 2 * n if n < 4 else n
    check_trains_like_one_process(comm, hybrid(comm, n, v=v, micro=micro), n_layer)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zero-bubble"])
def test_every_schedule_with_zero_over_dp(comm, schedule, zero):
    """pp 2 x dp 2 (the first four ranks), ZeRO 1, 2 and 3 under every schedule."""
    sub = comm.Split(0 if comm.rank < 4 else 1, comm.rank)
    try:
        if comm.rank < 4:
            v = 2 if schedule == "interleaved" else None
            check_trains_like_one_process(sub, hybrid(sub, 2, 2, zero=zero, schedule=schedule,
                                                      v=v), 2)
    finally:
        sub.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero", [0, 1])
def test_interleaved_without_overlap(comm, zero):
    """pp 2 x dp (the rest of an even world), v=2, gradients synchronised after the step's
    last backward (of chunk 0) instead of bucket by bucket during it."""
    n = comm.Get_size()
    if n % 2:
        pytest.skip("pp=2 needs an even world")
    config = ShardingConfiguration(dtype="float64", micro_batches=2, overlap=False)
    opt = HybridShardedOptimizer(make_opt(), config, pipeline_parallel_size=2,
                                 data_parallel_size=n // 2, zero_stage=zero,
                                 schedule="interleaved", virtual_stages=2, comm=comm)
    check_trains_like_one_process(comm, opt, 2)


@pytest.mark.mpi(min_size=2)
def test_interleaved_with_tensor_parallelism(comm):
    """pp 2 x tp (the rest of an even world), v=2, ZeRO 1."""
    n = comm.Get_size()
    if n % 2 or n > 4:
        pytest.skip("pp=2 x tp needs an even world of at most 4")
    config = ShardingConfiguration(dtype="float64", micro_batches=2)
    opt = HybridShardedOptimizer(make_opt(), config, pipeline_parallel_size=2,
                                 tensor_parallel_size=n // 2, data_parallel_size=1,
                                 zero_stage=1, schedule="interleaved", virtual_stages=2,
                                 comm=comm)
    check_trains_like_one_process(comm, opt, 2)


@pytest.mark.mpi(min_size=2)
def test_clear_errors_before_any_communication(comm):
    n = comm.Get_size()
    with pytest.raises(ValueError, match=f"schedule='interleaved' needs micro_batches a "
                                         f"multiple of pp={n}; got micro_batches={n + 1}"):
        hybrid(comm, n, v=2, micro=n + 1)
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule='interleaved' "
                                         "\\(got schedule='1f1b'\\)"):
        hybrid(comm, n, schedule="1f1b", v=2)
    with pytest.raises(ValueError, match="virtual_stages=0 must be a positive integer"):
        hybrid(comm, n, v=0)
    opt = hybrid(comm, n, v=3, micro=n)
    with pytest.raises(ValueError, match=f"virtual_stages=3 with pp={n} needs at least "
                                         f"{3 * n} units .*the model has 4"):
        opt.wrap(GPT(gpt(2)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("first,second", [
    (("interleaved", 1, 2), ("1f1b", 3, None)),
    (("zero-bubble", 3, None), ("interleaved", 2, 2)),
    (("interleaved", 0, 2), ("gpipe", 1, "pp1")),
])
def test_checkpoint_resumes_across_schedules(comm, tmp_path_factory, first, second):
    """Saved under one schedule (pp 2, dp the rest), loaded under another, with other
    virtual stages, sharding level or pipeline size: the same trajectory."""
    n = comm.Get_size()
    if n % 2:
        pytest.skip("pp=2 needs an even world")
    ref_losses, ref_params = reference(2, 2 * STEPS)
    path = comm.bcast(str(tmp_path_factory.mktemp("ckpt") / "ckpt.h5") if comm.rank == 0
                      else None)
    schedule, zero, v = first
    opt = hybrid(comm, 2, n // 2, zero=zero, schedule=schedule, v=v, micro=2)
    model = opt.wrap(GPT(gpt(2)), seed=0)
    losses = opt.optimize(model, data(), STEPS, global_batch_size=B).losses
    opt.save(path)
    model.free()
    schedule, zero, v = second
    pp = 1 if v == "pp1" else 2
    fresh = hybrid(comm, pp, n // pp, zero=zero, schedule=schedule,
                   v=None if v == "pp1" else v, micro=2)
    model = fresh.wrap(GPT(gpt(2)), seed=7)  # another init: overwritten by the load
    fresh.load(path)
    losses += fresh.optimize(model, data(), STEPS, global_batch_size=B).losses
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    got = model.full_parameters()
    for name, ref in ref_params.items():
        np.testing.assert_allclose(got[name], ref, **TOL, err_msg=name)
    model.free()
