"""Communication-efficient strategies without MPI: codecs, error feedback, one-rank runs."""

from __future__ import annotations

import numpy as np
import pytest
from strategy_helpers import make_case

from mpidist.core.buffers import Bucket, ShardedLayout
from mpidist.optim import SGD
from mpidist.parallel import (
    AsyncSGDOptimizer,
    CountingComm,
    DDPOptimizer,
    GradientCompressionOptimizer,
    LocalSGDOptimizer,
    ShardingConfiguration,
)
from mpidist.parallel.codecs import (
    PowerSGDCodec,
    TopKCodec,
    bf16_decode,
    bf16_encode,
    decode16,
    encode16,
)


def test_bf16_round_trip_is_nearest_even():
    x = np.array([1.0, -2.5, 1 + 2**-8, 1 + 3 * 2**-9, 3.0e38, np.inf, 1e-40, 0.0],
                 dtype=np.float32)
    got = bf16_decode(bf16_encode(x))
    # 1 + 2**-8 is halfway between 1 and 1 + 2**-7: ties go to the even mantissa (1.0).
    want = np.array([1.0, -2.5, 1.0, 1 + 2**-7, got[4], np.inf, got[6], 0.0], dtype=np.float32)
    np.testing.assert_array_equal(got, want)
    assert abs(got[4] - 3.0e38) / 3.0e38 < 2**-8
    assert np.isnan(bf16_decode(bf16_encode(np.array([np.nan], dtype=np.float32))))[0]


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_16bit_chunks_keep_tiny_gradients(kind):
    """fp16 chunks carry a power-of-two scale: 1e-9 gradients do not flush to zero."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000) * 1e-9
    out = np.empty(1001, dtype=np.uint16)
    encode16(x, kind, out)
    back = decode16(out, kind, np.dtype(np.float64))
    rel = np.abs(back - x).max() / np.abs(x).max()
    assert rel < (2**-10 if kind == "fp16" else 2**-7)


def test_topk_error_feedback_conserves_the_gradient_sum():
    rng = np.random.default_rng(1)
    codec = TopKCodec(100, 0.05, np.dtype(np.float64))
    assert codec.k == 5 and codec.index_dtype == np.int32
    total_in = np.zeros(100)
    total_sent = np.zeros(100)
    for _ in range(20):
        g = rng.standard_normal(100)
        total_in += g
        idx, vals = codec.compress(g)
        assert idx.size == vals.size == 5 and len(set(idx.tolist())) == 5
        dense = np.zeros(100)
        codec.decompress_sum(idx, vals, dense)
        total_sent += dense
        # the kept entries are the largest |g + residual|
        assert np.abs(vals).min() >= np.abs(codec.residual).max()
    np.testing.assert_allclose(total_sent + codec.residual, total_in, rtol=1e-12, atol=1e-12)


def test_powersgd_error_feedback_and_dense_parts():
    layout = ShardedLayout([[("w", (12, 10)), ("b", (10,)), ("small", (2, 2))]], 1, 0)
    bucket = Bucket(0, 0, layout.full_size, ("w", "b", "small"))
    codec = PowerSGDCodec(layout, bucket, 2, np.dtype(np.float64), seed=0)
    assert [m[0] for m in codec.matrices] == ["w"]  # 2x2 is cheaper sent dense
    assert codec.p_size == 24 and codec.q_size == 20
    rng = np.random.default_rng(2)
    total_in = np.zeros(layout.full_size)
    total_out = np.zeros(layout.full_size)
    for _ in range(10):
        g = rng.standard_normal(layout.full_size)
        total_in += g
        dense = codec.gather_dense(g)
        p = codec.compute_p(g)  # one rank: the "sum" over ranks is the local value
        phats, q_local = codec.compute_q(p)
        out = np.zeros_like(g)
        codec.finish(phats, q_local, q_local.copy(), out)
        codec.scatter_dense(dense, out)
        w = out[:120].reshape(12, 10)
        assert np.linalg.matrix_rank(w) <= 2
        np.testing.assert_array_equal(out[120:], g[120:])  # bias and small matrix exact
        total_out += out
    np.testing.assert_allclose(total_out + codec.residual, total_in, rtol=1e-10, atol=1e-10)


class _FakeComm:
    def __init__(self, size=4, rank=1):
        self.size, self.rank, self.calls = size, rank, []

    def Get_size(self):  # noqa: N802
        return self.size

    def Get_rank(self):  # noqa: N802
        return self.rank

    def Iallreduce(self, s, r, op=None):  # noqa: N802
        self.calls.append("Iallreduce")

    def Iallgather(self, s, r):  # noqa: N802
        self.calls.append("Iallgather")

    def Ialltoallv(self, s, r):  # noqa: N802
        self.calls.append("Ialltoallv")


def test_counting_comm_counts_send_buffers():
    from mpi4py import MPI

    fake = _FakeComm()
    total = CountingComm(fake)
    second = CountingComm(fake, totals=total)
    total.Iallreduce(MPI.IN_PLACE, np.zeros(10, dtype=np.float32), op=MPI.SUM)
    assert total.bytes == 40
    total.Iallgather(np.zeros(3, dtype=np.int32), np.zeros(12, dtype=np.int32))
    assert total.bytes == 52
    second.Iallgather(MPI.IN_PLACE, np.zeros(8, dtype=np.uint16))  # own segment: 2 of 8
    assert second.bytes == 4 and total.bytes == 56
    buf = np.zeros(12, dtype=np.uint16)
    counts = [3, 0, 3, 3]  # nothing addressed to ourselves (rank 1)
    displs = [0, 3, 6, 9]
    total.Ialltoallv([buf, (counts, displs), MPI.UINT16_T],
                     [buf.copy(), (counts, displs), MPI.UINT16_T])
    assert total.bytes == 56 + 18 and total.calls == 4
    assert fake.calls == ["Iallreduce", "Iallgather", "Iallgather", "Ialltoallv"]


def test_arguments_are_validated():
    opt = SGD(lr=0.1)
    with pytest.raises(ValueError, match="method='gzip'"):
        GradientCompressionOptimizer(opt, method="gzip")
    with pytest.raises(ValueError, match="ratio=0"):
        GradientCompressionOptimizer(opt, method="topk", ratio=0)
    with pytest.raises(ValueError, match="rank=0"):
        GradientCompressionOptimizer(opt, method="powersgd", rank=0)
    with pytest.raises(ValueError, match="sync_every=0"):
        LocalSGDOptimizer(opt, sync_every=0)
    with pytest.raises(ValueError, match="staleness=-1"):
        AsyncSGDOptimizer(opt, staleness=-1)


def _run(factory, steps=6, kind="gpt"):
    from mpi4py import MPI

    from mpidist.core.mesh import ProcessMesh

    make_model, data, loss, make_opt = make_case(kind)
    cfg = ShardingConfiguration(mesh=ProcessMesh(MPI.COMM_SELF), dtype="float64",
                                bucket_mb=0.002)
    opt = factory(make_opt(), cfg, loss)
    model = opt.wrap(make_model(), seed=0)
    return opt.optimize(model, data, steps, global_batch_size=12), opt, model


def test_one_rank_exact_variants_equal_ddp():
    ref, _, _ = _run(lambda b, c, l: DDPOptimizer(b, c, loss=l))
    for factory in (lambda b, c, l: GradientCompressionOptimizer(b, c, method="none", loss=l),
                    lambda b, c, l: AsyncSGDOptimizer(b, c, staleness=0, loss=l),
                    lambda b, c, l: LocalSGDOptimizer(b, c, sync_every=3, loss=l)):
        got, opt, _ = _run(factory)
        np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-12)
        assert opt.bytes_sent == 0  # a group of one makes no MPI call


def test_one_rank_async_pipeline_fills_then_flushes():
    _, opt, model = _run(lambda b, c, l: AsyncSGDOptimizer(b, c, staleness=2, loss=l), steps=2)
    # The first `staleness` steps apply nothing: the parameters are still the initial ones.
    _, _, fresh = _run(lambda b, c, l: DDPOptimizer(b, c, loss=l), steps=0)
    np.testing.assert_array_equal(model.params, fresh.params)
    assert opt.in_flight == 2 and opt.applied == 0
    _, opt, model = _run(lambda b, c, l: AsyncSGDOptimizer(b, c, staleness=2, loss=l), steps=5)
    assert opt.in_flight == 2 and opt.applied == 3
    opt.flush()
    assert opt.in_flight == 0 and opt.applied == 5 and opt.state.step == 5
    assert opt.memory_report()["gradient_copies"] == 3 * model.grads.nbytes
