"""The engine on a device, without a GPU: every array a FakeArray (tests/fake_device.py), which
refuses any NumPy-only call the way CuPy arrays do, and the CUDA kernels under the Numba
simulator. The device path must give the CPU's trajectory (float64), checkpoints must move
between devices, and mixed precision must keep float32 master weights and skip the steps
whose fp16 gradients overflow. Run with ``NUMBA_ENABLE_CUDASIM=1 pytest -m cudasim``."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from strategy_helpers import make_case, reference_run

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from fake_device import FAKE, FakeArray, HostMix  # noqa: E402

from mpidist.core.arrays import to_host  # noqa: E402
from mpidist.core.mesh import ProcessMesh  # noqa: E402
from mpidist.nn import GPT, GPTConfig  # noqa: E402
from mpidist.parallel import STRATEGIES, ShardingConfiguration  # noqa: E402

pytestmark = [pytest.mark.cudasim, pytest.mark.timeout(600)]

# Small enough for the simulator (it runs each CUDA thread as a Python thread).
TINY = GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=8)
STEPS, B = 2, 8


def _run(comm, strategy, *, device="cpu", precision="full", dtype="float64", steps=STEPS,
         micro=1, pp=1, tp=1):
    make_model, data, loss, make_opt = make_case("gpt", TINY)
    config = ShardingConfiguration(mesh=ProcessMesh(comm, pp=pp, tp=tp), dtype=dtype,
                                   micro_batches=micro, bucket_mb=0.002, device=device,
                                   precision=precision)
    opt = STRATEGIES[strategy](make_opt(), config, loss=loss)
    model = opt.wrap(make_model(), seed=0)
    result = opt.optimize(model, data, steps, global_batch_size=B)
    return result, opt, model


def test_the_fake_array_refuses_numpy_only_calls():
    a = FAKE.zeros(3, np.float64)
    with pytest.raises(HostMix):
        np.asarray(a)
    with pytest.raises(HostMix):
        a + np.ones(3)
    assert isinstance(a + 1.0, FakeArray) and isinstance(np.exp(a), FakeArray)
    assert float((a + 2.0).sum()) == 6.0


def test_gpt_forward_backward_on_the_device_equals_the_cpu():
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (2, 8)), rng.integers(0, 256, (2, 8))
    out = {}
    for name, dev in (("cpu", None), ("fake", FAKE)):
        from mpidist.nn import CrossEntropyLoss

        m, lf = GPT(TINY), CrossEntropyLoss()
        _, g = m.build(np.float64, seed=1, device=dev)
        loss = lf.forward(m.forward(x), y)
        m.backward(lf.backward())
        out[name] = (loss, to_host(g.data))
    assert isinstance(g.data, FakeArray)
    assert abs(out["cpu"][0] - out["fake"][0]) <= 1e-12 * abs(out["cpu"][0])
    np.testing.assert_allclose(out["fake"][1], out["cpu"][1], rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow),
                                      pytest.param("zero1", marks=pytest.mark.slow), "zero3"])
def test_training_on_the_device_follows_the_cpu_trajectory(comm, strategy):
    want_losses, want = reference_run("gpt", STEPS, B, "float64", gpt=TINY)
    result, _, model = _run(comm, strategy, device=FAKE)
    assert isinstance(model.parameter_storage, FakeArray)
    np.testing.assert_allclose(result.losses, want_losses, rtol=1e-10)
    for name, arr in model.full_parameters().items():
        np.testing.assert_allclose(arr, want[name], rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", [{"pp": 2, "micro": 2}, {"tp": 2}], ids=["pipeline", "tensor"])
def test_pipeline_and_tensor_parallel_on_the_device_follow_the_cpu(comm, layout):
    want_losses, _ = reference_run("gpt", STEPS, B, "float64", gpt=TINY)
    result, _, _ = _run(comm, "hybrid", device=FAKE, **layout)
    np.testing.assert_allclose(result.losses, want_losses, rtol=1e-10)


def test_a_checkpoint_moves_between_device_and_cpu(comm, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt")) if comm.Get_rank() == 0 else None
    path = os.path.join(comm.bcast(d), "ckpt.h5")
    _, opt, model = _run(comm, "zero1", device=FAKE)
    opt.save(path)
    _, cpu_opt, cpu_model = _run(comm, "zero1", steps=0)
    cpu_opt.load(path)
    _, back_opt, back_model = _run(comm, "zero3", device=FAKE, steps=0)
    back_opt.load(path)
    want = model.full_parameters()
    for got in (cpu_model.full_parameters(), back_model.full_parameters()):
        for name, arr in got.items():
            np.testing.assert_array_equal(arr, want[name], err_msg=name)
    assert cpu_opt.state.step == back_opt.state.step == opt.state.step


@pytest.mark.slow  # make test-slow (make test: a checkpoint between device and CPU)
def test_an_async_checkpoint_copies_device_arrays_into_pinned_memory(comm, tmp_path_factory):
    from mpidist.checkpoint.background import default_pool

    d = str(tmp_path_factory.mktemp("async")) if comm.Get_rank() == 0 else None
    path = os.path.join(comm.bcast(d), "ckpt.h5")
    _, opt, model = _run(comm, "zero1", device=FAKE)
    want = model.full_parameters()
    handle = opt.save(path, async_=True)
    assert default_pool().pinned  # the snapshot of device pieces is pinned host memory
    _, data, _, _ = make_case("gpt", TINY)
    opt.optimize(model, data, 1, global_batch_size=B)  # the device arrays change
    handle.wait()
    _, cpu_opt, cpu_model = _run(comm, "zero1", steps=0)
    cpu_opt.load(path)
    assert cpu_opt.state.step == STEPS
    for name, arr in cpu_model.full_parameters().items():
        np.testing.assert_array_equal(arr, want[name], err_msg=name)


def test_mixed_fp16_keeps_float32_master_weights(comm):
    # ZeRO-3: the 16-bit copy is what is gathered. Full precision on the CPU is the
    # reference (the device path gives the CPU's trajectory: tested above).
    full, _, _ = _run(comm, "zero3", dtype="float32", steps=3)
    mixed, opt, model = _run(comm, "zero3", device=FAKE, dtype="float32",
                             precision="mixed-fp16", steps=3)
    assert model.parameter_storage.dtype == np.float32
    assert model.compute_dtype == np.float16
    assert opt.scaler.skipped == 0
    # 16-bit activations: the losses follow full precision to fp16 round-off.
    np.testing.assert_allclose(mixed.losses, full.losses, rtol=2e-3)


@pytest.mark.filterwarnings("ignore:.*overflow:RuntimeWarning")  # the point of the test
def test_fp16_overflow_skips_the_step_and_backs_off(comm, tmp_path_factory):
    _, opt, model = _run(comm, "ddp", device=FAKE, dtype="float32", precision="mixed-fp16",
                         steps=1)
    before = to_host(model.parameter_storage).copy()
    step = opt.state.step
    opt.scaler.scale = 2.0**60  # the scaled fp16 gradients overflow
    from strategy_helpers import make_case as _make

    _, data, _, _ = _make("gpt", TINY)
    opt.optimize(model, data, 1, global_batch_size=B)
    assert opt.scaler.skipped == 1 and opt.scaler.scale == 2.0**59
    assert opt.state.step == step  # no optimizer step was taken
    np.testing.assert_array_equal(to_host(model.parameter_storage), before)
    opt.scaler.scale = 2.0**10
    opt.optimize(model, data, 1, global_batch_size=B)
    assert opt.state.step == step + 1
    assert not np.array_equal(to_host(model.parameter_storage), before)
    # The scale and its counters travel in the checkpoint with the master weights.
    d = str(tmp_path_factory.mktemp("fp16")) if comm.Get_rank() == 0 else None
    path = os.path.join(comm.bcast(d), "ckpt.h5")
    opt.save(path)
    _, again, again_model = _run(comm, "ddp", device=FAKE, dtype="float32",
                                 precision="mixed-fp16", steps=0)
    again.load(path)
    assert again.scaler.state_dict() == opt.scaler.state_dict()
    np.testing.assert_array_equal(to_host(again_model.parameter_storage),
                                  to_host(model.parameter_storage))


def test_mixed_precision_where_it_cannot_run_is_refused_with_the_reason(comm):
    with pytest.raises(ValueError, match="needs a GPU"):
        _run(comm, "ddp", dtype="float32", precision="mixed-fp16")
    with pytest.raises(ValueError, match="bfloat16|ml_dtypes"):
        _run(comm, "ddp", device=FAKE, dtype="float32", precision="mixed-bf16")
    with pytest.raises(ValueError, match="master weights"):
        ShardingConfiguration(dtype="float64", precision="mixed-fp16")


def test_what_does_not_run_on_a_device_is_refused_before_communicating():
    from mpidist.optim import AdamW
    from mpidist.parallel import (
        ElasticOptimizer,
        GradientCompressionOptimizer,
        HybridShardedOptimizer,
    )

    class Untouchable:  # any communication would fail the test
        def Get_size(self):
            return 2

        def __getattr__(self, name):
            raise AssertionError(f"communicated: {name}")

    cfg = ShardingConfiguration(device=FAKE, dtype="float32", precision="mixed-fp16")
    with pytest.raises(ValueError, match="tensor parallelism"):
        HybridShardedOptimizer(AdamW(), cfg, pipeline_parallel_size=1, tensor_parallel_size=2,
                               comm=Untouchable()).wrap(GPT(TINY))
    with pytest.raises(ValueError, match="host arrays"):
        GradientCompressionOptimizer(AdamW(), ShardingConfiguration(device=FAKE),
                                     comm=Untouchable()).wrap(GPT(TINY))
    with pytest.raises(ValueError, match="elastic"):
        ElasticOptimizer(AdamW(), ShardingConfiguration(device=FAKE), comm=Untouchable())
