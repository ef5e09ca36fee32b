"""The kernel dispatcher and the CPU kernels' argument checks, reductions and dtypes."""

from __future__ import annotations

import numpy as np
import pytest

import mpidist.optim as optim
import mpidist.optim.kernels as k

DTYPES = [np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 1000, 100_003])
def test_sum_of_squares_matches_numpy_in_float64(n, dtype):
    x = np.random.default_rng(n).standard_normal(n).astype(dtype)
    ref = float(np.sum(x.astype(np.float64) ** 2))
    got = k.sum_of_squares(x)
    assert isinstance(got, float)
    np.testing.assert_allclose(got, ref, rtol=1e-12)


def test_sum_of_squares_accumulates_in_float64():
    # 2**25 ones squared is exact in float64 but not reachable by a float32 running sum.
    x = np.ones(2**25 + 3, np.float32)
    assert k.sum_of_squares(x) == float(2**25 + 3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_keep_the_dtype_and_work_in_place(dtype):
    p = np.ones(5, dtype)
    g = np.full(5, 0.5, dtype)
    m, v = np.zeros(5, dtype), np.zeros(5, dtype)
    optim.fused_adam(p, g, m, v, step_size=0.1, bias_correction2_sqrt=0.1, beta1=0.9,
                     beta2=0.99, eps=1e-8)
    assert p.dtype == m.dtype == v.dtype == dtype
    np.testing.assert_allclose(m, 0.05, rtol=1e-6)
    np.testing.assert_allclose(v, 0.01 * 0.25, rtol=1e-6)
    assert np.all(p < 1)


def test_sgd_without_momentum():
    p = np.array([1.0, 2.0])
    optim.fused_sgd(p, np.array([1.0, -1.0]), lr=0.5, weight_decay=0.1, grad_scale=2.0)
    np.testing.assert_array_equal(p, [1.0 - 0.5 * (2.0 + 0.1), 2.0 - 0.5 * (-2.0 + 0.2)])


def test_lion_sign_of_zero_leaves_the_parameter():
    p = np.array([1.0, 1.0, 1.0])
    m = np.zeros(3)
    optim.fused_lion(p, np.array([0.0, 2.0, -2.0]), m, lr=0.25, beta1=0.9, beta2=0.99)
    np.testing.assert_array_equal(p, [1.0, 0.75, 1.25])


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="grad has shape"):
        optim.fused_sgd(np.zeros(4), np.zeros(5), lr=0.1)


def test_dtype_mismatch_is_named():
    with pytest.raises(ValueError, match="float32"):
        optim.fused_sgd(np.zeros(4), np.zeros(4, np.float32), lr=0.1)


def test_unsupported_dtype_is_named():
    with pytest.raises(ValueError, match="int64"):
        optim.fused_sgd(np.zeros(4, np.int64), np.zeros(4, np.int64), lr=0.1)


def test_two_dimensional_is_rejected():
    with pytest.raises(ValueError, match=r"1-D.*\(2, 2\)"):
        k.sum_of_squares(np.zeros((2, 2)))


def test_non_contiguous_is_rejected():
    with pytest.raises(ValueError, match="C-contiguous"):
        optim.fused_sgd(np.zeros(8)[::2], np.zeros(4), lr=0.1)


def test_read_only_output_is_rejected():
    p = np.zeros(4)
    p.flags.writeable = False
    with pytest.raises(ValueError, match="param is read-only"):
        optim.fused_sgd(p, np.zeros(4), lr=0.1)


def test_read_only_gradient_is_fine():
    g = np.ones(4)
    g.flags.writeable = False
    p = np.zeros(4)
    optim.fused_sgd(p, g, lr=0.5)
    np.testing.assert_array_equal(p, -0.5)


class _FakeDeviceArray:
    """Stands for a CUDA array: dispatch must look at the interface, not the type."""

    shape = (4,)
    dtype = np.dtype(np.float64)
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f8", "data": (0, False), "version": 3}


def test_host_and_device_arrays_do_not_mix():
    assert k.is_device_array(_FakeDeviceArray())
    assert not k.is_device_array(np.zeros(3))
    with pytest.raises(TypeError, match="grad=device"):
        optim.fused_sgd(np.zeros(4), _FakeDeviceArray(), lr=0.1)


def test_warm_up_runs():
    k.warm_up()
    optim.warm_up()


def test_every_optimizer_kernel_is_one_update_body_for_cpu_and_cuda():
    """Each registered optimizer's update is an Update whose CPU kernel loops over the same
    element body the CUDA kernel is built from."""
    import importlib

    for cls in optim.OPTIMIZERS.values():
        module = importlib.import_module(cls.__module__)
        updates = [u for u in vars(module).values() if isinstance(u, k.Update)]
        assert len(updates) == 1, cls
        (u,) = updates
        assert u.cpu.py_func.__module__ == u.element.__module__ == cls.__module__
