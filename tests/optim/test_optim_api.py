"""Optimizer construction, validation, serialisation of hyperparameters and state."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mpidist.optim as optim

BAD = [
    ("sgd", {"lr": -0.1}, "lr=-0.1"),
    ("sgd", {"momentum": -0.5}, "momentum=-0.5"),
    ("sgd", {"dampening": 1.5}, "dampening=1.5"),
    ("sgd", {"weight_decay": -1e-3}, "weight_decay=-0.001"),
    ("sgd", {"nesterov": True}, "momentum=0.0"),
    ("sgd", {"nesterov": True, "momentum": 0.9, "dampening": 0.1}, "dampening=0.1"),
    ("sgd", {"nesterov": 1, "momentum": 0.9}, "nesterov=1"),
    ("sgd", {"momentom": 0.9}, "momentom=0.9"),
    ("adam", {"betas": (1.5, 0.9)}, "betas[0]=1.5 must be in [0, 1)"),
    ("adam", {"betas": (0.9, 1.0)}, "betas[1]=1.0"),
    ("adam", {"betas": (-0.1, 0.9)}, "betas[0]=-0.1"),
    ("adam", {"betas": 0.9}, "betas=0.9"),
    ("adam", {"eps": 0.0}, "eps=0.0"),
    ("adam", {"eps": -1e-8}, "eps=-1e-08"),
    ("adam", {"lr": float("nan")}, "lr=nan"),
    ("adam", {"lr": "0.1"}, "lr='0.1'"),
    ("adam", {"weight_decay": -0.1}, "weight_decay=-0.1"),
    ("adam", {"amsgrad": "yes"}, "amsgrad='yes'"),
    ("adam", {"momentum": 0.9}, "momentum=0.9"),
    ("adamw", {"weight_decay": -0.01}, "weight_decay=-0.01"),
    ("adamw", {"betas": (0.9, 7)}, "betas[1]=7"),
    ("rmsprop", {"alpha": 1.2}, "alpha=1.2"),
    ("rmsprop", {"eps": 0}, "eps=0"),
    ("rmsprop", {"momentum": -1}, "momentum=-1"),
    ("adagrad", {"lr_decay": -1.0}, "lr_decay=-1.0"),
    ("adagrad", {"initial_accumulator_value": -0.5}, "initial_accumulator_value=-0.5"),
    ("adagrad", {"eps": -1.0}, "eps=-1.0"),
    ("lion", {"betas": (0.9, 1.5)}, "betas[1]=1.5"),
    ("lion", {"weight_decay": -2.0}, "weight_decay=-2.0"),
    ("lion", {"eps": 1e-8}, "eps=1e-08"),
]


@pytest.mark.parametrize(("name", "hp", "text"), BAD, ids=[f"{n}-{t}" for n, _, t in BAD])
def test_bad_hyperparameters_name_the_value(name, hp, text):
    with pytest.raises(ValueError) as info:
        optim.create(name, **hp)
    assert text in str(info.value)
    assert str(info.value).startswith(optim.OPTIMIZERS[name].__name__ + ":")


def test_direct_construction_rejects_unknown_options_with_value_error():
    with pytest.raises(ValueError, match="unknown option foo=1"):
        optim.Adam(foo=1)


def test_unknown_optimizer():
    with pytest.raises(ValueError, match="'adamax'"):
        optim.create("adamax")


@pytest.mark.parametrize("name", sorted(optim.OPTIMIZERS))
def test_config_round_trip_through_json(name):
    opt = optim.create(name, lr=0.123)
    text = json.dumps(opt.config())
    back = optim.from_config(json.loads(text))
    assert back == opt
    assert type(back) is type(opt)


def test_create_is_case_insensitive_and_hyperparameters_are_frozen():
    opt = optim.create("AdamW", lr=1)
    assert isinstance(opt, optim.AdamW) and opt.lr == 1.0 and isinstance(opt.lr, float)
    with pytest.raises(AttributeError):
        opt.lr = 0.5  # type: ignore[misc]


def test_from_config_needs_a_name():
    with pytest.raises(ValueError, match="no 'name'"):
        optim.from_config({"lr": 0.1})


STATEFUL = [
    ("sgd", {"momentum": 0.9}),
    ("sgd", {}),
    ("adam", {"amsgrad": True}),
    ("adamw", {}),
    ("rmsprop", {"centered": True, "momentum": 0.5}),
    ("adagrad", {"initial_accumulator_value": 0.25}),
    ("lion", {}),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("name", "hp"), STATEFUL, ids=[n for n, _ in STATEFUL])
def test_state_round_trip_continues_identically(name, hp, dtype):
    rng = np.random.default_rng(0)
    opt = optim.create(name, **hp)
    p = rng.standard_normal(64).astype(dtype)
    st = opt.init_state(p)
    for _ in range(5):
        opt.update(p, rng.standard_normal(64).astype(dtype), st)
    d = opt.state_to_dict(st)
    assert d["step"] == 5 and set(d) == {"step", *opt.state_names()}
    # Through plain arrays and ints, as a checkpoint would store them.
    d2 = {key: (np.array(v) if isinstance(v, np.ndarray) else int(v)) for key, v in d.items()}
    st2 = optim.from_config(opt.config()).state_from_dict(d2)
    p2 = p.copy()
    for _ in range(5):
        g = rng.standard_normal(64).astype(dtype)
        opt.update(p, g, st)
        opt.update(p2, g, st2)
    np.testing.assert_array_equal(p, p2)
    assert st2.step == 10


def test_init_state_from_length_and_param():
    opt = optim.Adagrad(initial_accumulator_value=0.5)
    st = opt.init_state(3)
    assert st.step == 0 and st["sum"].dtype == np.float64
    np.testing.assert_array_equal(st["sum"], 0.5)
    st32 = opt.init_state(np.zeros(4, np.float32))
    assert st32["sum"].dtype == np.float32 and st32["sum"].shape == (4,)
    assert optim.SGD().init_state(5).buffers == {}
    with pytest.raises(ValueError, match="n=-1"):
        opt.init_state(-1)
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        opt.init_state(np.zeros((2, 2)))
    with pytest.raises(ValueError, match="int32"):
        opt.init_state(3, dtype=np.int32)


def test_state_from_dict_rejects_wrong_keys_and_lengths():
    opt = optim.Adam()
    with pytest.raises(ValueError, match="missing"):
        opt.state_from_dict({"step": 1, "exp_avg": np.zeros(3)})
    with pytest.raises(ValueError, match="length 4"):
        opt.state_from_dict({"step": 1, "exp_avg": np.zeros(3), "exp_avg_sq": np.zeros(4)})
    with pytest.raises(ValueError, match="step=-1"):
        opt.state_from_dict({"step": -1, "exp_avg": np.zeros(3), "exp_avg_sq": np.zeros(3)})
    st = opt.state_from_dict(
        {"step": np.int64(2), "exp_avg": np.zeros(3), "exp_avg_sq": np.zeros(3)},
        like=np.zeros(3, np.float32),
    )
    assert st.step == 2 and st["exp_avg"].dtype == np.float32


def test_update_checks_lr_override_and_state():
    opt = optim.SGD(momentum=0.9)
    p = np.zeros(3)
    with pytest.raises(ValueError, match="lr=-1.0"):
        opt.update(p, np.ones(3), opt.init_state(p), lr=-1.0)
    with pytest.raises(ValueError, match="momentum_buffer"):
        opt.update(p, np.ones(3), optim.SGD().init_state(p))
    with pytest.raises(ValueError, match="grad has shape"):
        opt.update(p, np.ones(4), opt.init_state(p))


def test_update_is_in_place_and_counts_steps():
    opt = optim.SGD(lr=0.5)
    p = np.ones(3)
    st = opt.init_state(p)
    view = p
    opt.update(p, np.ones(3), st, grad_scale=0.5)
    assert view is p and st.step == 1
    np.testing.assert_array_equal(p, 0.75)
