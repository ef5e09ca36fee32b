"""Mixed precision's pieces that need no device: the loss scale's rule, the refusals, the
16-bit gather (at more ranks: tests/core/test_collectives.py). The engine under mixed
precision is tested on the fake device: tests/parallel/test_device.py."""

from __future__ import annotations

import numpy as np
import pytest

from mpidist.core import collectives as C
from mpidist.parallel.precision import LossScaler, ScaledLoss, compute_dtype


def test_the_loss_scale_backs_off_on_overflow_and_grows_after_good_steps():
    s = LossScaler(scale=1024.0, growth_interval=3)
    assert s.update(True) is True and s.scale == 512.0 and s.skipped == 1
    assert [s.update(False) for _ in range(3)] == [False] * 3
    assert s.scale == 1024.0 and s.good_steps == 0
    s.update(False)
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.good_steps, t.skipped) == (1024.0, 1, 1)


def test_nonfinite_gradients_are_found(comm):
    s = LossScaler()
    assert not s.found_nonfinite([np.ones(3), np.zeros(0)], comm)
    assert s.found_nonfinite([np.ones(3), np.array([1.0, np.inf])], comm)
    assert s.found_nonfinite([np.array([np.nan], dtype=np.float32)], comm)


def test_the_scaled_loss_starts_backward_from_the_scale():
    class Loss:
        def forward(self, y, t, normalizer=None, ctx=None):
            return 2.0

        def backward(self, dy=1.0, ctx=None):
            return dy

    s = LossScaler(scale=8.0)
    loss = ScaledLoss(Loss(), s)
    assert loss.forward(None, None) == 2.0 and loss.backward(ctx=0) == 8.0


def test_mixed_precision_on_the_cpu_is_refused_with_the_reason():
    assert compute_dtype("full", np) is None
    for p in ("mixed-fp16", "mixed-bf16"):
        with pytest.raises(ValueError, match="needs a GPU"):
            compute_dtype(p, np)


def test_16_bit_values_are_gathered_bit_for_bit():
    x = np.array([1.5, -2.25, 65504.0], dtype=np.float16)
    out = np.empty(3, dtype=np.float16)
    got = C.iallgather(x, comm=None, out=out).wait()
    assert got is out and got.dtype == np.float16
    np.testing.assert_array_equal(got, x)
    np.testing.assert_array_equal(C.allgather(np.arange(3.0), comm=None), np.arange(3.0))
