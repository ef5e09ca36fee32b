"""mpidist.torch.optim's fused Adam, AdamW and SGD against torch.optim: the same trajectory
(float64, 1e-10), state dicts that move both ways, and use under ZeroRedundancyOptimizer and
torch's own fully_shard on the mpidist backend."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_models as M  # noqa: E402

from mpidist.torch import ZeroRedundancyOptimizer  # noqa: E402
from mpidist.torch import optim as fused  # noqa: E402

CASES = [
    ("Adam", {"lr": 3e-3}),
    ("Adam", {"lr": 3e-3, "weight_decay": 0.1, "amsgrad": True, "maximize": True}),
    ("AdamW", {"lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 0.05}),
    ("SGD", {"lr": 0.05}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-3}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "maximize": True}),
]


def loss_of(model, step, rank=0, size=1, batch=8):
    # (the MLP, not the GPT: an attention's key bias has a gradient of pure round-off, whose
    # sign Adam's normalised step turns into +-lr, so two exact implementations part there)
    x, y = M.batch("mlp", step, batch * size)
    x, y = M.local(x, rank, size), M.local(y, rank, size)
    return torch.nn.functional.cross_entropy(model(x), y)


def run(model, opt, steps, start=0):
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
        sched.step()


def state_arrays(opt):
    return {f"{k}/{n}": (v.detach().numpy().copy() if torch.is_tensor(v) else v)
            for k, s in opt.state_dict()["state"].items() for n, v in s.items()}


@pytest.mark.parametrize("name,kw", CASES)
def test_fused_equals_torch_and_state_dicts_move_both_ways(name, kw):
    ours_model, ref_model = M.make_mlp(), M.make_mlp()
    ours = getattr(fused, name)(ours_model.parameters(), **kw)
    ref = getattr(torch.optim, name)(ref_model.parameters(), **kw)
    run(ours_model, ours, 5)
    run(ref_model, ref, 5)
    M.assert_close(M.params_of(ours_model), M.params_of(ref_model), what=name)
    a, b = state_arrays(ours), state_arrays(ref)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-10, atol=1e-14, err_msg=k)
    assert ours.state_dict()["param_groups"] == ref.state_dict()["param_groups"]
    # torch's state into ours (and ours into torch) continues the same trajectory
    swapped_model, back_model = copy.deepcopy(ref_model), copy.deepcopy(ours_model)
    swapped = getattr(fused, name)(swapped_model.parameters(), **kw)
    swapped.load_state_dict(copy.deepcopy(ref.state_dict()))
    back = getattr(torch.optim, name)(back_model.parameters(), **kw)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    for m, o in ((swapped_model, swapped), (back_model, back), (ref_model, ref)):
        run(m, o, 2, start=5)
    M.assert_close(M.params_of(swapped_model), M.params_of(ref_model), what="torch -> ours")
    M.assert_close(M.params_of(back_model), M.params_of(ref_model), what="ours -> torch")


def test_float32_matches_to_round_off():
    ours_model, ref_model = M.make_mlp().float(), M.make_mlp().float()
    ours = fused.AdamW(ours_model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for model, opt in ((ours_model, ours), (ref_model, ref)):
        for step in range(3):
            x, y = M.batch("mlp", step, 8)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x.float()), y).backward()
            opt.step()
    for (n, a), b in zip(ours_model.named_parameters(), ref_model.parameters(), strict=True):
        assert a.dtype == torch.float32
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=n)


@pytest.mark.parametrize("option", ["fused", "foreach", "capturable", "differentiable"])
def test_torch_only_options_are_one_clear_line(option):
    with pytest.raises(ValueError, match=rf"AdamW: {option}=True is not supported"):
        fused.AdamW(M.make("gpt").parameters(), **{option: True})


def test_non_contiguous_parameter_is_named():
    p = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64).t())
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="parameter is not contiguous"):
        fused.SGD([p], lr=0.1).step()


@pytest.mark.mpi(min_size=2)
def test_as_the_optimizer_class_of_zero_redundancy(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    models, opts = [], []
    for cls in (fused.AdamW, torch.optim.AdamW):
        model = M.make_mlp()
        models.append(model)
        opts.append(ZeroRedundancyOptimizer(model.parameters(), cls, comm=comm, lr=3e-3))
    for model, opt in zip(models, opts, strict=True):
        for step in range(4):
            opt.zero_grad()
            loss_of(model, step, rank, size).backward()
            for p in model.parameters():  # the data-parallel mean, as a DDP wrapper gives it
                p.grad.copy_(torch.from_numpy(comm.allreduce(p.grad.numpy())) / size)
            opt.step()
    M.assert_close(M.params_of(models[0]), M.params_of(models[1]), what="ZeRO")


@pytest.mark.mpi(min_size=2)
def test_on_torch_fully_shard_over_the_backend(comm):
    from torch.distributed.fsdp import fully_shard

    M.use_backend("mpidist", comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    result = []
    for cls in (fused.Adam, torch.optim.Adam):
        model = M.make_mlp()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = cls(model.parameters(), lr=1e-2, weight_decay=0.01)
        for step in range(4):
            opt.zero_grad()
            loss_of(model, step, rank, size).backward()
            opt.step()
        result.append({n: p.full_tensor().detach().numpy().copy()
                       for n, p in model.named_parameters()})
    M.assert_close(result[0], result[1], what="fully_shard")


# -- the multi-tensor (flat) path ----------------------------------------------------------
ODD_SHAPES = [(7, 3), (5,), (1,), (3, 2, 4), (11,), (2, 9)]
FLAT_CASES = [
    ("Adam", {"lr": 3e-3}),
    ("Adam", {"lr": 3e-3, "weight_decay": 0.1, "amsgrad": True, "maximize": True}),
    ("AdamW", {"lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 0.05, "amsgrad": True}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1, "maximize": True}),
]


def odd_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64))
            for s in ODD_SHAPES]


def grads_of(params, step, skip):
    """Gradients of a fixed quadratic-ish loss; parameter ``skip(step)`` gets none."""
    loss = sum((p * p).sum() * (k + 1) + (p.sin() * (step + 1)).sum()
               for k, p in enumerate(params) if k not in skip(step))
    loss.backward()


def drive(params, opt, steps, start=0, zero=lambda opt, ps: opt.zero_grad()):
    skip = lambda step: {1} if step % 3 == 1 else ({4} if step % 4 == 0 else set())  # noqa: E731
    for step in range(start, start + steps):
        zero(opt, params)
        grads_of(params, step, skip)
        opt.step()


def assert_same(a_params, b_params, a_opt, b_opt, what):
    for k, (a, b) in enumerate(zip(a_params, b_params, strict=True)):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-12,
                                   atol=1e-14, err_msg=f"{what}: param {k}")
    a, b = state_arrays(a_opt), state_arrays(b_opt)
    assert a.keys() == b.keys(), what
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-12, atol=1e-14, err_msg=f"{what}: {k}")


def set_none(opt, params):
    opt.zero_grad()


def model_zero(opt, params):  # what model.zero_grad() does (set_to_none=True)
    for p in params:
        p.grad = None


def keep_zeros(opt, params):
    opt.zero_grad(set_to_none=False)


@pytest.mark.parametrize("zero", [set_none, model_zero, keep_zeros])
@pytest.mark.parametrize("name,kw", FLAT_CASES)
def test_flat_path_equals_torch_with_missing_grads(name, kw, zero):
    ours_p, ref_p = odd_params(), odd_params()
    ours = getattr(fused, name)(ours_p, **kw)
    ref = getattr(torch.optim, name)(ref_p, foreach=False, **kw)
    drive(ours_p, ours, 7, zero=zero)
    drive(ref_p, ref, 7, zero=zero)
    assert_same(ours_p, ref_p, ours, ref, name)
    # one flat buffer: the parameters and their state are views of it
    flat = ours._flat.groups[0].buckets
    assert len(flat) == 1 and len(flat[0].params) == len(ODD_SHAPES)
    base = flat[0].flat.data_ptr()
    assert sorted(p.data_ptr() - base for p in ours_p) == sorted(
        8 * o for o in flat[0].offsets)
    assert all(torch.is_tensor(ours.state[p]["step"]) for p in ours_p)
    with_grad = [p for p in ours_p if p.grad is not None]
    if zero is keep_zeros:  # the gradients stay views of the flat gradient
        assert all(p.grad is v for p, v in zip(ours_p, flat[0].views["grad"], strict=True))
    assert with_grad


@pytest.mark.parametrize("name,kw", FLAT_CASES[1:3])
def test_flat_state_dict_round_trip(name, kw):
    ours_p, ref_p = odd_params(), odd_params()
    ours = getattr(fused, name)(ours_p, **kw)
    ref = getattr(torch.optim, name)(ref_p, foreach=False, **kw)
    drive(ours_p, ours, 4)
    drive(ref_p, ref, 4)
    saved = copy.deepcopy(ours.state_dict())
    # a new optimizer (and new parameters) loads the saved state and continues equal
    new_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    new = getattr(fused, name)(new_p, **kw)
    new.load_state_dict(saved)
    # the old one also loads torch's state (replacing its flat views) and continues equal
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    for params, opt in ((new_p, new), (ours_p, ours), (ref_p, ref)):
        drive(params, opt, 4, start=4)
    assert_same(new_p, ref_p, new, ref, "saved -> new optimizer")
    assert_same(ours_p, ref_p, ours, ref, "torch's state -> ours")
    bucket = new._flat.groups[0].buckets[0]
    assert all(new.state[p]["exp_avg"] is v for p, v in
               zip(bucket.params, bucket.views["exp_avg"], strict=True))


def test_flat_uses_a_shared_flat_storage_as_it_is_and_falls_back_per_tensor():
    storage = torch.zeros(40, dtype=torch.float64)
    views = [torch.nn.Parameter(storage[10:22].view(3, 4)), torch.nn.Parameter(storage[:10])]
    alone = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    strided = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64).t())
    f32 = torch.nn.Parameter(torch.randn(6, dtype=torch.float32))
    params = [*views, alone, strided, f32]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = fused.AdamW(params, lr=1e-2)
    ref = torch.optim.AdamW(refs, lr=1e-2, foreach=False)
    for opt, ps in ((ours, params), (ref, refs)):
        for step in range(3):
            opt.zero_grad()
            sum((p.double().cos() * (k + step)).sum() for k, p in enumerate(ps)
                if k != 3).backward()  # the strided one gets no gradient (or it would raise)
            opt.step()
    for a, b in zip(params, refs, strict=True):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-6)
    g = ours._flat.groups[0]
    assert storage.data_ptr() in {b.flat.data_ptr() for b in g.buckets}  # used in place
    assert views[0].data_ptr() == storage.data_ptr() + 80  # not re-pointed
    assert {len(b.params) for b in g.buckets} == {2, 1}  # the views; alone+f32 differ in dtype
    assert g.rest == [strided]


def test_flat_false_is_the_per_tensor_path():
    ours_p, ref_p = odd_params(), odd_params()
    ours = fused.AdamW(ours_p, lr=1e-2, flat=False)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, foreach=False)
    drive(ours_p, ours, 4)
    drive(ref_p, ref, 4)
    assert_same(ours_p, ref_p, ours, ref, "flat=False")
    assert ours._flat is None
