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
