"""CUDA kernels against the CPU kernels, under the Numba CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1 pytest -m cudasim``). Tiny sizes: the simulator is slow."""

from __future__ import annotations

import os

import numpy as np
import pytest

import mpidist.optim as optim
import mpidist.optim.kernels as k

pytestmark = [
    pytest.mark.cudasim,
    pytest.mark.skipif(
        os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="needs NUMBA_ENABLE_CUDASIM=1"
    ),
]

N = 300  # more than one block of 256 threads, so the grid-stride loop is exercised
STEPS = 3
TOL = {np.float64: {"rtol": 1e-12, "atol": 1e-14}, np.float32: {"rtol": 1e-6, "atol": 1e-6}}

CASES = [
    ("sgd", {"lr": 0.05, "weight_decay": 0.1}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "maximize": True}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "dampening": 0.2}),
    ("adam", {"lr": 0.01, "weight_decay": 0.1}),
    ("adam", {"lr": 0.01, "amsgrad": True, "maximize": True}),
    ("adamw", {"lr": 0.01, "weight_decay": 0.1}),
    ("rmsprop", {"lr": 0.01}),
    ("rmsprop", {"lr": 0.01, "centered": True, "momentum": 0.9, "weight_decay": 0.1}),
    ("adagrad", {"lr": 0.05, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
    ("lion", {"lr": 0.001, "weight_decay": 0.1}),
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize(("name", "hp"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_cuda_matches_cpu(name, hp, dtype):
    from numba import cuda

    rng = np.random.default_rng(5)
    opt = optim.create(name, **hp)
    p_cpu = rng.standard_normal(N).astype(dtype)
    p_dev = cuda.to_device(p_cpu.copy())
    st_cpu = opt.init_state(p_cpu)
    st_dev = opt.init_state(p_dev)
    assert all(k.is_device_array(b) for b in st_dev.buffers.values())
    for step in range(STEPS):
        g = rng.standard_normal(N).astype(dtype)
        lr = opt.lr * (1 + step) / STEPS
        opt.update(p_cpu, g, st_cpu, grad_scale=0.5, lr=lr)
        opt.update(p_dev, cuda.to_device(g), st_dev, grad_scale=0.5, lr=lr)
    np.testing.assert_allclose(p_dev.copy_to_host(), p_cpu, **TOL[dtype])
    host = opt.state_to_dict(st_dev)
    for key, ref in opt.state_to_dict(st_cpu).items():
        np.testing.assert_allclose(host[key], ref, **TOL[dtype], err_msg=key)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sum_of_squares_on_device(dtype):
    from numba import cuda

    x = np.random.default_rng(1).standard_normal(600).astype(dtype)
    ref = float(np.sum(x.astype(np.float64) ** 2))
    np.testing.assert_allclose(k.sum_of_squares(cuda.to_device(x)), ref, rtol=1e-12)
    assert k.sum_of_squares(cuda.to_device(np.zeros(0, dtype))) == 0.0


def test_state_round_trip_onto_device():
    from numba import cuda

    opt = optim.Adam(amsgrad=True)
    p = cuda.to_device(np.ones(10, np.float32))
    st = opt.init_state(p)
    opt.update(p, cuda.to_device(np.full(10, 0.5, np.float32)), st)
    d = opt.state_to_dict(st)
    back = opt.state_from_dict(d, like=p)
    assert back.step == 1
    for key in opt.state_names():
        assert k.is_device_array(back[key])
        np.testing.assert_array_equal(back[key].copy_to_host(), d[key])


def test_clip_scale_on_device():
    from numba import cuda

    x = np.arange(10, dtype=np.float64)
    scale, norm = optim.clip_scale([cuda.to_device(x)], 1.0)
    np.testing.assert_allclose(norm, np.linalg.norm(x), rtol=1e-14)
    np.testing.assert_allclose(scale, 1.0 / (norm + 1e-6), rtol=1e-14)


class _ForeignDeviceArray:
    """A device array of a library NumPy does not know (as a torch CUDA tensor is): a
    ``dtype`` NumPy cannot interpret and no array namespace, only the CUDA array
    interface of the memory it holds."""

    dtype = "foreign.float32"

    def __init__(self, host: np.ndarray) -> None:
        self.host = host  # the simulator's "device" memory is host memory
        self.shape = host.shape
        self.__cuda_array_interface__ = {
            "shape": host.shape, "typestr": host.dtype.str, "strides": None,
            "data": (host.ctypes.data, False), "version": 3}


def test_foreign_device_array_takes_numba_state_and_matches_cpu():
    """A parameter given as another library's device array (a torch CUDA tensor on a GPU;
    found there: ``init_state`` took ``np.dtype(torch.float64)`` and failed) gets Numba
    device state buffers and the CPU kernel's result."""
    from numba import cuda

    rng = np.random.default_rng(9)
    opt = optim.create("adamw", lr=0.01, weight_decay=0.1)
    p_cpu = rng.standard_normal(N).astype(np.float32)
    p_dev = _ForeignDeviceArray(p_cpu.copy())
    st_cpu, st_dev = opt.init_state(p_cpu), opt.init_state(p_dev)
    assert all(k.is_device_array(b) and hasattr(b, "copy_to_host")
               for b in st_dev.buffers.values())
    for _ in range(STEPS):
        g = rng.standard_normal(N).astype(np.float32)
        opt.update(p_cpu, g, st_cpu)
        opt.update(p_dev, cuda.to_device(g), st_dev)
    np.testing.assert_allclose(p_dev.host, p_cpu, **TOL[np.float32])
