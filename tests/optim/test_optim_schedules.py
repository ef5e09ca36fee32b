"""Learning-rate schedules."""

from __future__ import annotations

import math

import pytest

import mpidist.optim as optim


def test_constant():
    s = optim.ConstantSchedule(0.1)
    assert [s(i) for i in (0, 1, 10**6)] == [0.1] * 3


def test_warmup_cosine():
    s = optim.WarmupCosineSchedule(lr=1.0, total_steps=110, warmup_steps=10, min_lr=0.1)
    assert s(0) == pytest.approx(0.1)
    assert s(4) == pytest.approx(0.5)
    assert s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s(35) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert s(110) == s(500) == 0.1
    values = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_cosine_without_warmup():
    s = optim.WarmupCosineSchedule(lr=2.0, total_steps=4)
    assert [s(i) for i in range(5)] == pytest.approx([2.0, 1.0 + 2**-0.5, 1.0, 1 - 2**-0.5, 0.0])


def test_step_decay():
    s = optim.StepDecaySchedule(lr=1.0, step_size=3, gamma=0.5)
    assert [s(i) for i in range(7)] == [1, 1, 1, 0.5, 0.5, 0.5, 0.25]


@pytest.mark.parametrize(
    "schedule",
    [
        optim.ConstantSchedule(0.5),
        optim.WarmupCosineSchedule(lr=1.0, total_steps=10, warmup_steps=2, min_lr=0.01),
        optim.StepDecaySchedule(lr=1.0, step_size=5),
    ],
)
def test_config_round_trip(schedule):
    assert optim.schedule_from_config(schedule.config()) == schedule


@pytest.mark.parametrize(
    ("name", "kwargs", "text"),
    [
        ("constant", {"lr": -1.0}, "lr=-1.0"),
        ("warmup_cosine", {"lr": 1.0, "total_steps": 0}, "total_steps=0"),
        ("warmup_cosine", {"lr": 1.0, "total_steps": 5, "warmup_steps": 6}, "warmup_steps=6"),
        ("warmup_cosine", {"lr": 1.0, "total_steps": 5, "min_lr": 2.0}, "min_lr=2.0"),
        ("step", {"lr": 1.0, "step_size": 0}, "step_size=0"),
        ("step", {"lr": 1.0, "step_size": 2, "gama": 0.1}, "gama=0.1"),
        ("step", {"lr": 1.0}, "step_size"),
        ("cosine", {"lr": 1.0}, "'cosine'"),
    ],
)
def test_bad_schedules(name, kwargs, text):
    with pytest.raises(ValueError) as info:
        optim.create_schedule(name, **kwargs)
    assert text in str(info.value)


def test_negative_step():
    with pytest.raises(ValueError, match="step=-1"):
        optim.ConstantSchedule(0.1)(-1)
