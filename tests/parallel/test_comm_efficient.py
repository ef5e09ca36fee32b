"""Local SGD, gradient compression and async SGD under MPI: exactness, convergence, bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from strategy_helpers import make_case

from mpidist.core import collectives as C
from mpidist.core.mesh import ProcessMesh
from mpidist.data import TextCorpus
from mpidist.optim import SGD
from mpidist.parallel import (
    AsyncSGDOptimizer,
    DDPOptimizer,
    GradientCompressionOptimizer,
    LocalSGDOptimizer,
    ShardingConfiguration,
)

B = 24  # divisible by 1, 2, 3 and 4 ranks
EXACT = dict(rtol=1e-12, atol=1e-15)


def build(comm, factory, dtype="float64", optimizer=None, bucket_mb=0.002, kind="gpt"):
    make_model, data, loss, make_opt = make_case(kind)
    config = ShardingConfiguration(mesh=ProcessMesh(comm), dtype=dtype, bucket_mb=bucket_mb)
    opt = factory(optimizer() if optimizer else make_opt(), config, loss)
    model = opt.wrap(make_model(), seed=0)
    return opt, model, data


def train(comm, factory, steps, check=None, **kw):
    opt, model, data = build(comm, factory, **kw)
    result = opt.optimize(model, data, steps, global_batch_size=B,
                          callback=(lambda s, l: check(opt, model)) if check else None)
    return result, opt, model


def ddp(b, c, loss):
    return DDPOptimizer(b, c, loss=loss)


def identical(opt, model):
    everyone = C.allgather(model.params, comm=model.comm).reshape(model.dp_size, -1)
    assert (everyone == everyone[0]).all(), "replicas diverged"


# -- exactly DDP -----------------------------------------------------------------------------
EXACT_VARIANTS = {
    "local_sgd_H1_sgd": (lambda b, c, l: LocalSGDOptimizer(b, c, sync_every=1, loss=l),
                         lambda: SGD(lr=0.5)),
    "compression_none": (lambda b, c, l: GradientCompressionOptimizer(b, c, method="none",
                                                                      loss=l), None),
    "async_s0": (lambda b, c, l: AsyncSGDOptimizer(b, c, staleness=0, loss=l), None),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("variant", sorted(EXACT_VARIANTS))
def test_equals_ddp(comm, variant):
    factory, optimizer = EXACT_VARIANTS[variant]
    ref, _, ref_model = train(comm, ddp, 12, optimizer=optimizer)
    got, opt, model = train(comm, factory, 12, optimizer=optimizer, check=identical)
    np.testing.assert_allclose(got.losses, ref.losses, **EXACT)
    np.testing.assert_allclose(model.params, ref_model.params, **EXACT)
    assert opt.bytes_sent > 0


# -- convergence within a stated margin of DDP ------------------------------------------------
STEPS = 40
_VAL: dict[str, tuple] = {}


def validation_loss(model, loss):
    if "batch" not in _VAL:
        val = TextCorpus(8, split="validation")
        _VAL["batch"] = val.batch(np.linspace(0, len(val) - 1, 256).astype(np.int64))
    x, y = _VAL["batch"]
    return loss.forward(model.forward(x), y)


# Margins: relative excess of the validation loss over DDP's after 40 AdamW steps (float32,
# B=24, the 2-layer GPT of strategy_helpers, 2 KiB buckets), measured at 2, 3 and 4 ranks
# and rounded up: fp16/bf16 < 1e-4, PowerSGD r=4 0.04%, Local SGD H=4 0.6-1.8%, async s=1
# 3.0%, top-k 10% 12.8-14.2%. Top-k with Adam is the weak spot: Adam's per-coordinate
# normalisation turns the sparse, delayed coordinates into uneven steps.
CONVERGENCE = {
    "fp16": (lambda b, c, l: GradientCompressionOptimizer(b, c, method="fp16", loss=l), 0.001),
    "bf16": (lambda b, c, l: GradientCompressionOptimizer(b, c, method="bf16", loss=l), 0.001),
    "topk_0.1": (lambda b, c, l: GradientCompressionOptimizer(b, c, method="topk", ratio=0.1,
                                                              loss=l), 0.18),
    "powersgd_r4": (lambda b, c, l: GradientCompressionOptimizer(b, c, method="powersgd",
                                                                 rank=4, loss=l), 0.01),
    "local_sgd_H4": (lambda b, c, l: LocalSGDOptimizer(b, c, sync_every=4, loss=l), 0.03),
    "async_s1": (lambda b, c, l: AsyncSGDOptimizer(b, c, staleness=1, loss=l), 0.04),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("method", list(CONVERGENCE))
def test_validation_loss_close_to_ddp(comm, method):
    factory, margin = CONVERGENCE[method]
    loss = make_case("gpt")[2]
    if "ddp" not in _VAL:
        _, _, ref_model = train(comm, ddp, STEPS, dtype="float32")
        _VAL["ddp"] = validation_loss(ref_model, loss)
    _, opt, model = train(comm, factory, STEPS, dtype="float32")
    if isinstance(opt, AsyncSGDOptimizer):
        opt.flush()
    if isinstance(opt, LocalSGDOptimizer):
        opt.average_replicas()
    identical(opt, model)
    got, ref = validation_loss(model, loss), _VAL["ddp"]
    assert got <= ref * (1 + margin), f"{method}: {got:.4f} vs DDP {ref:.4f}"


# -- measured bytes ---------------------------------------------------------------------------
def compression(method, **kw):
    return lambda b, c, l: GradientCompressionOptimizer(b, c, method=method, loss=l, **kw)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bytes_dense_and_16bit(comm, dtype):
    _, none, model = train(comm, compression("none"), 2, dtype=dtype)
    assert none.bytes_sent_last_step == model.grads.nbytes == model.hook.dense_bytes // 2
    assert none.compression_ratio == 1.0
    n = model.dp_size
    for method in ("fp16", "bf16"):
        _, opt, model = train(comm, compression(method), 2, dtype=dtype)
        # reduce-scatter by Alltoallv (n-1 chunks leave) + in-place allgather (1 chunk),
        # each chunk ceil(m/n) 16-bit values and one 16-bit scale exponent
        want = sum(n * (math.ceil(b.size / n) + 1) * 2 for b in model.buckets)
        assert opt.bytes_sent_last_step == want
        half = 0.5 if dtype == "float32" else 0.25
        assert half <= opt.compression_ratio < half * 1.05, opt.compression_ratio


@pytest.mark.mpi(min_size=2)
def test_bytes_topk_is_about_the_ratio(comm):
    _, opt, model = train(comm, compression("topk", ratio=0.01), 2, dtype="float32",
                          bucket_mb=0.05)
    ks = [math.ceil(0.01 * b.size) for b in model.buckets]
    # int32 index + float32 value per kept entry; never the dense vector
    assert opt.bytes_sent_last_step == sum(ks) * (4 + 4)
    assert set(model.hook.meter.by_op) == {"Iallgather"}
    assert 0.02 <= opt.compression_ratio < 0.022  # 1% values + 1% indices


@pytest.mark.mpi(min_size=2)
def test_bytes_powersgd(comm):
    _, opt, model = train(comm, compression("powersgd", rank=2), 2, dtype="float32")
    want = sum(4 * (c.dense_index.size + c.p_size + c.q_size) for c in model.hook.codecs)
    assert opt.bytes_sent_last_step == want
    assert opt.compression_ratio < 0.3


@pytest.mark.mpi(min_size=2)
def test_bytes_local_sgd_and_async(comm):
    _, opt, model = train(comm, lambda b, c, l: LocalSGDOptimizer(b, c, sync_every=4, loss=l),
                          8)
    assert opt.bytes_sent == 2 * model.params.nbytes and opt.averages == 2
    _, opt, model = train(comm, lambda b, c, l: LocalSGDOptimizer(
        b, c, sync_every=4, average_optimizer_state=True, loss=l), 8)
    state = sum(b.nbytes for b in opt.state.buffers.values())
    assert state == 2 * model.params.nbytes  # AdamW: exp_avg, exp_avg_sq
    assert opt.bytes_sent == 2 * (model.params.nbytes + state)
    _, opt, model = train(comm, lambda b, c, l: AsyncSGDOptimizer(b, c, staleness=2, loss=l), 5)
    assert opt.bytes_sent_last_step == model.grads.nbytes and opt.bytes_sent_per_step == \
        model.grads.nbytes


# -- error feedback ---------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_topk_error_feedback_in_training(comm):
    """Per rank: sent + residual = sum of the gradients; per step: the applied gradient is
    the sum over ranks of what was sent."""
    opt, model, data = build(comm, compression("topk", ratio=0.05))
    codec = model.hook.codecs[0]
    b = model.buckets[0]
    seen = {"in": np.zeros(codec.size), "sent": np.zeros(codec.size), "last": None}
    inner = codec.compress

    def record(grad):
        seen["in"] += grad
        idx, vals = inner(grad)
        dense = np.zeros(codec.size)
        np.add.at(dense, idx, vals)
        seen["sent"] += dense
        seen["last"] = dense
        return idx, vals

    codec.compress = record
    for _ in range(6):
        opt.optimize(model, data, 1, global_batch_size=B)
        applied = C.allreduce(seen["last"].copy(), "sum", comm=comm)
        np.testing.assert_allclose(model.grads[b.start:b.stop], applied, **EXACT)
    np.testing.assert_allclose(seen["sent"] + codec.residual, seen["in"], rtol=1e-12,
                               atol=1e-15)
    assert np.abs(codec.residual).max() > 0


# -- replica behaviour ------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_local_sgd_replicas_differ_between_syncs(comm):
    opt, model, data = build(comm, lambda b, c, l: LocalSGDOptimizer(b, c, sync_every=3, loss=l))
    for step in range(1, 7):
        opt.optimize(model, data, 1, global_batch_size=B)
        everyone = C.allgather(model.params, comm=comm).reshape(comm.Get_size(), -1)
        same = bool((everyone == everyone[0]).all())
        assert same == (step % 3 == 0), step
    d = opt.state_dict()  # the replica average, replicas untouched
    assert d["steps_taken"] == 6 and opt.bytes_sent == 2 * model.params.nbytes


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("method", ["fp16", "bf16", "topk", "powersgd"])
def test_compressed_replicas_stay_identical(comm, method):
    train(comm, compression(method), 4, dtype="float32", check=identical)


@pytest.mark.mpi(min_size=2)
def test_async_staleness_semantics(comm):
    """Step t applies the summed gradient of step t-s; the first s steps apply nothing.

    The reference replays that rule by hand on a DDP model (its own bucketed sync).
    """
    from mpidist.data import GlobalBatchSampler

    s, steps = 2, 6
    got, opt, model = train(comm, lambda b, c, l: AsyncSGDOptimizer(b, c, staleness=s, loss=l),
                            steps, optimizer=lambda: SGD(lr=0.5), check=identical)
    assert opt.in_flight == s and opt.applied == steps - s
    ref_opt, ref, data = build(comm, ddp, optimizer=lambda: SGD(lr=0.5))
    loss = make_case("gpt")[2]
    sampler = GlobalBatchSampler(len(data), B, seed=0)
    queue, losses = [], []
    for _ in range(steps):
        x, y = data.batch(sampler.next_local(ref.dp_rank, ref.dp_size))
        ref.zero_grad()
        local = loss.forward(ref.forward(x), y, normalizer=y.size * ref.dp_size)
        ref.backward(loss.backward())
        ref.finish_gradient_sync()
        losses.append(C.allreduce(np.array([local]), "sum", comm=comm)[0])
        queue.append(ref.grads.copy())
        while len(queue) > s:
            ref_opt.base.update(ref.params, queue.pop(0), ref_opt.pieces[0][2])
    np.testing.assert_allclose(got.losses, losses, **EXACT)
    np.testing.assert_allclose(model.params, ref.params, **EXACT)
    opt.flush()
    for g in queue:
        ref_opt.base.update(ref.params, g, ref_opt.pieces[0][2])
    assert opt.in_flight == 0 and opt.applied == steps
    np.testing.assert_allclose(model.params, ref.params, **EXACT)


@pytest.mark.mpi(min_size=2)
def test_inflight_allreduce_buffer_outlives_its_owner(comm):
    """mpi4py keeps no reference to an Iallreduce's buffer: the chain must, until the
    exchange completes, even when whoever started it dropped the array."""
    import gc
    import weakref

    from mpidist.parallel import exchange as ce

    buf = np.full(1000, float(comm.Get_rank() + 1))
    alive = weakref.ref(buf)
    chain = ce.RequestChain(ce.iallreduce(buf, comm), None)
    del buf
    gc.collect()
    assert alive() is not None, "an in-flight allreduce lost its buffer"
    chain.wait()
    gc.collect()
    assert alive() is None, "a finished exchange still pins its buffer"
