"""mpidist.torch.ZeroRedundancyOptimizer equals torch's (gloo) and keeps 1/N of the state."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_models as M  # noqa: E402

from mpidist.torch import DistributedDataParallel, ZeroRedundancyOptimizer  # noqa: E402

STEPS = 10
GB = 24


def train(kind, comm, mine: bool, optimizer_class, **defaults):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    rank, size = comm.Get_rank(), comm.Get_size()
    model = M.make(kind)
    unused = kind == "bn"
    if mine:
        net = DistributedDataParallel(model, comm=comm, find_unused_parameters=unused)
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class, comm=comm, **defaults)
    else:
        net = TorchDDP(model, find_unused_parameters=unused)
        opt = TorchZeRO(net.parameters(), optimizer_class, **defaults)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    losses = []
    for step in range(STEPS):
        x, y = M.batch(kind, step, GB)
        opt.zero_grad()
        loss = M.loss_of(kind, net, M.local(x, rank, size), M.local(y, rank, size))
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    opt.consolidate_state_dict(to=0)
    state = opt.state_dict() if rank == 0 else None
    return np.array(losses), M.params_of(model), state, opt


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind,cls,defaults", [
    ("gpt", "AdamW", {"lr": 3e-3, "weight_decay": 0.01}),
    ("bn", "SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
])
def test_zero_equals_torch_zero(comm, kind, cls, defaults):
    M.gloo(comm)
    optimizer_class = getattr(torch.optim, cls)
    ours = train(kind, comm, True, optimizer_class, **defaults)
    ref = train(kind, comm, False, optimizer_class, **defaults)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-10)
    M.assert_close(ours[1], ref[1], what="params")
    if comm.Get_rank() == 0:
        a, b = ours[2], ref[2]
        assert a["param_groups"] == b["param_groups"]
        assert a["state"].keys() == b["state"].keys()
        for i in a["state"]:
            for key in a["state"][i]:
                np.testing.assert_allclose(np.asarray(a["state"][i][key]),
                                           np.asarray(b["state"][i][key]), rtol=1e-9,
                                           atol=1e-14)
    # optimizer state is partitioned: each parameter's state on exactly one rank
    opt = ours[3]
    mine = sum(v.numel() for st in opt.optim.state.values() for v in st.values() if v.dim())
    everyone = comm.allgather(mine)
    total = sum(v.numel() for st in (ours[2] or {"state": {}})["state"].values()
                for v in st.values() if torch.is_tensor(v) and v.dim())
    if comm.Get_rank() == 0:
        assert sum(everyone) == total
    assert max(everyone) < 0.8 * sum(everyone)


@pytest.mark.mpi(min_size=2)
def test_zero_state_dict_loads_into_plain_optimizer_and_back(comm):
    model = M.make("gpt")
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, comm=comm, lr=1e-2)
    x, y = M.batch("gpt", 0, GB)
    M.loss_of("gpt", model, x, y).backward()
    opt.step()
    opt.consolidate_state_dict(to=0)
    state = comm.bcast(opt.state_dict() if comm.Get_rank() == 0 else None, root=0)
    plain_model = M.make("gpt")
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-2)
    plain.load_state_dict(state)  # torch's own format
    again = ZeroRedundancyOptimizer(M.make("gpt").parameters(), torch.optim.Adam, comm=comm,
                                    lr=5.0)
    again.load_state_dict(state)
    assert again.param_groups[0]["lr"] == 1e-2
    again.consolidate_state_dict(to=0)
    if comm.Get_rank() == 0:
        back = again.state_dict()
        for i, st in state["state"].items():
            torch.testing.assert_close(back["state"][i]["exp_avg"], st["exp_avg"])
    if comm.Get_rank() != 0:  # consolidated on rank 0 only
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            again.state_dict()


@pytest.mark.mpi(min_size=2)
def test_zero_bad_input_fails_on_every_rank(comm):
    model = torch.nn.Linear(3, 3)
    lr = 0.1 if comm.Get_rank() == 0 else 0.2
    with pytest.raises(ValueError, match="differ between ranks"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, comm=comm, lr=lr)
    with pytest.raises(ValueError, match="not a torch optimizer class"):
        ZeroRedundancyOptimizer(model.parameters(), object, comm=comm, lr=0.1)
