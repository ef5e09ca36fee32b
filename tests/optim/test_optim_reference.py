"""Every optimizer and option against a plain, unfused NumPy transcription of the
``torch.optim`` algorithm (and of lion-pytorch), over 50 steps of random gradients; and
against torch.optim itself where torch is installed."""

from __future__ import annotations

import numpy as np
import pytest

import mpidist.optim as optim

N = 257
STEPS = 50

# (optimizer name, options); each runs in float32 and float64, with grad_scale 1 and the
# configured lr, and with grad_scale != 1 and a per-step lr override from a schedule.
CASES = [
    ("sgd", {"lr": 0.05}),
    ("sgd", {"lr": 0.05, "weight_decay": 0.05}),
    ("sgd", {"lr": 0.05, "momentum": 0.9}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "dampening": 0.1}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    ("sgd", {"lr": 0.05, "momentum": 0.5, "weight_decay": 0.1, "maximize": True}),
    ("sgd", {"lr": 0.05, "maximize": True}),
    ("adam", {"lr": 0.01}),
    ("adam", {"lr": 0.01, "weight_decay": 0.1}),
    ("adam", {"lr": 0.01, "amsgrad": True}),
    ("adam", {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6}),
    ("adam", {"lr": 0.01, "weight_decay": 0.01, "maximize": True}),
    ("adam", {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True, "maximize": True}),
    ("adamw", {"lr": 0.01}),
    ("adamw", {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
    ("adamw", {"lr": 0.01, "betas": (0.5, 0.9), "eps": 1e-5, "maximize": True}),
    ("rmsprop", {"lr": 0.01}),
    ("rmsprop", {"lr": 0.01, "centered": True}),
    ("rmsprop", {"lr": 0.01, "momentum": 0.9}),
    ("rmsprop", {"lr": 0.01, "centered": True, "momentum": 0.9, "weight_decay": 0.1}),
    ("rmsprop", {"lr": 0.01, "alpha": 0.9, "eps": 1e-6, "maximize": True}),
    ("adagrad", {"lr": 0.05}),
    ("adagrad", {"lr": 0.05, "lr_decay": 0.01}),
    ("adagrad", {"lr": 0.05, "initial_accumulator_value": 0.1, "weight_decay": 0.1}),
    ("adagrad", {"lr": 0.05, "eps": 1e-6, "maximize": True}),
    ("lion", {"lr": 0.001}),
    ("lion", {"lr": 0.001, "weight_decay": 0.1}),
    ("lion", {"lr": 0.001, "betas": (0.95, 0.98), "weight_decay": 1.0}),
]

TOL = {np.float64: {"rtol": 1e-12, "atol": 1e-14}, np.float32: {"rtol": 1e-6, "atol": 1e-6}}


def reference_step(name, hp, p, g, st, t, lr):
    """One unfused step, written as the torch.optim (lion-pytorch) pseudo-code. ``g`` is
    already multiplied by grad_scale; ``t`` counts from 1. Returns the new p; updates st."""
    if hp.get("maximize", False):
        g = -g
    wd = hp.get("weight_decay", 0.0)
    if name == "sgd":
        mom, damp = hp.get("momentum", 0.0), hp.get("dampening", 0.0)
        if wd != 0:
            g = g + wd * p
        if mom != 0:
            if t == 1:
                st["momentum_buffer"] = g.copy()
            else:
                st["momentum_buffer"] = mom * st["momentum_buffer"] + (1 - damp) * g
            buf = st["momentum_buffer"]
            g = g + mom * buf if hp.get("nesterov", False) else buf
        return p - lr * g
    if name in ("adam", "adamw"):
        b1, b2 = hp.get("betas", (0.9, 0.999))
        eps = hp.get("eps", 1e-8)
        if name == "adamw":
            p = p * (1 - lr * hp.get("weight_decay", 1e-2))
        elif wd != 0:
            g = g + wd * p
        st["exp_avg"] = b1 * st["exp_avg"] + (1 - b1) * g
        st["exp_avg_sq"] = b2 * st["exp_avg_sq"] + (1 - b2) * g * g
        bc1 = 1 - b1**t
        bc2 = 1 - b2**t
        if hp.get("amsgrad", False):
            st["max_exp_avg_sq"] = np.maximum(st["max_exp_avg_sq"], st["exp_avg_sq"])
            denom = np.sqrt(st["max_exp_avg_sq"]) / bc2**0.5 + eps
        else:
            denom = np.sqrt(st["exp_avg_sq"]) / bc2**0.5 + eps
        return p - (lr / bc1) * (st["exp_avg"] / denom)
    if name == "rmsprop":
        alpha, eps, mom = hp.get("alpha", 0.99), hp.get("eps", 1e-8), hp.get("momentum", 0.0)
        if wd != 0:
            g = g + wd * p
        st["square_avg"] = alpha * st["square_avg"] + (1 - alpha) * g * g
        if hp.get("centered", False):
            st["grad_avg"] = alpha * st["grad_avg"] + (1 - alpha) * g
            avg = np.sqrt(st["square_avg"] - st["grad_avg"] * st["grad_avg"]) + eps
        else:
            avg = np.sqrt(st["square_avg"]) + eps
        if mom > 0:
            st["momentum_buffer"] = mom * st["momentum_buffer"] + g / avg
            return p - lr * st["momentum_buffer"]
        return p - lr * (g / avg)
    if name == "adagrad":
        eps = hp.get("eps", 1e-10)
        if wd != 0:
            g = g + wd * p
        clr = lr / (1 + (t - 1) * hp.get("lr_decay", 0.0))
        st["sum"] = st["sum"] + g * g
        return p - clr * (g / (np.sqrt(st["sum"]) + eps))
    if name == "lion":
        b1, b2 = hp.get("betas", (0.9, 0.99))
        p = p * (1 - lr * wd)
        c = b1 * st["exp_avg"] + (1 - b1) * g
        p = p - lr * np.sign(c)
        st["exp_avg"] = b2 * st["exp_avg"] + (1 - b2) * g
        return p
    raise AssertionError(name)


def reference_initial_state(opt, n, dtype):
    value = getattr(opt, "initial_accumulator_value", 0.0)
    return {k: np.full(n, value, dtype) for k in opt.state_names()}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("variant", ["plain", "scaled_scheduled"])
@pytest.mark.parametrize(("name", "hp"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_matches_numpy_reference(name, hp, variant, dtype):
    rng = np.random.default_rng(1234)
    opt = optim.create(name, **hp)
    p = rng.standard_normal(N).astype(dtype)
    p_ref = p.copy()
    state = opt.init_state(p)
    st_ref = reference_initial_state(opt, N, dtype)
    schedule = optim.WarmupCosineSchedule(lr=opt.lr, total_steps=STEPS, warmup_steps=5)
    grad_scale = 1.0 if variant == "plain" else 0.37
    for step in range(STEPS):
        g = rng.standard_normal(N).astype(dtype)
        lr = None if variant == "plain" else schedule(step)
        opt.update(p, g, state, grad_scale=grad_scale, lr=lr)
        g_ref = g if grad_scale == 1.0 else g * grad_scale
        lr_ref = opt.lr if lr is None else lr
        p_ref = reference_step(name, hp, p_ref, g_ref, st_ref, step + 1, lr_ref)
        assert p_ref.dtype == dtype
    assert state.step == STEPS
    np.testing.assert_allclose(p, p_ref, **TOL[dtype])
    for key, ref in st_ref.items():
        np.testing.assert_allclose(state[key], ref, **TOL[dtype], err_msg=key)


def test_cases_cover_every_option():
    seen: dict[str, set[str]] = {}
    for name, hp in CASES:
        seen.setdefault(name, set()).update(hp)
    for name, cls in optim.OPTIMIZERS.items():
        assert set(cls().hyperparameters()) <= seen[name], name


# -- torch ------------------------------------------------------------------------------------

TORCH_CASES = [c for c in CASES if c[0] != "lion"]


@pytest.mark.parametrize(
    ("name", "hp"), TORCH_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(TORCH_CASES)]
)
def test_matches_torch(name, hp):
    torch = pytest.importorskip("torch")
    cls = {
        "sgd": torch.optim.SGD,
        "adam": torch.optim.Adam,
        "adamw": torch.optim.AdamW,
        "rmsprop": torch.optim.RMSprop,
        "adagrad": torch.optim.Adagrad,
    }[name]
    rng = np.random.default_rng(7)
    p = rng.standard_normal(N)
    tp = torch.nn.Parameter(torch.tensor(p.copy(), dtype=torch.float64))
    topt = cls([tp], **hp, foreach=False)
    opt = optim.create(name, **hp)
    state = opt.init_state(p)
    for _ in range(20):
        g = rng.standard_normal(N)
        tp.grad = torch.tensor(g.copy())
        topt.step()
        opt.update(p, g, state)
    # torch uses lerp and different operation orders: agreement to round-off, not bitwise.
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-9, atol=1e-12)


def test_defaults_match_torch():
    expected = {
        "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0,
                "nesterov": False, "maximize": False},
        "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                 "amsgrad": False, "maximize": False},
        "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2,
                  "amsgrad": False, "maximize": False},
        "rmsprop": {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0,
                    "momentum": 0.0, "centered": False, "maximize": False},
        "adagrad": {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0,
                    "initial_accumulator_value": 0.0, "eps": 1e-10, "maximize": False},
        "lion": {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0},
    }
    for name, hp in expected.items():
        assert optim.create(name).hyperparameters() == hp, name
