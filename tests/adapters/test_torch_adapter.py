"""The torch adapter: torch modules trained by mpidist's strategies equal plain torch training."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpidist.adapters.torch import TorchLoss, TorchModule, wrap_torch  # noqa: E402
from mpidist.mesh import ProcessMesh  # noqa: E402
from mpidist.optim import SGD, Adam  # noqa: E402
from mpidist.parallel import ShardingConfiguration  # noqa: E402

STEPS = 4
B = 24  # divisible by 1, 2, 3, 4 ranks times 2 micro-batches
D_IN, D_OUT = 6, 5


def make_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(D_IN, 16), torch.nn.Tanh(), torch.nn.Linear(16, 12), torch.nn.GELU(),
        torch.nn.Linear(12, D_OUT),
    ).double()


def data(step: int):
    rng = np.random.default_rng(100 + step)
    return rng.normal(size=(B, D_IN)), rng.integers(0, D_OUT, size=B)


def torch_reference(optimizer: str, steps: int = STEPS):
    net = make_net()
    if optimizer == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    losses = []
    for s in range(steps):
        x, y = data(s)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses), {n: p.detach().numpy().copy() for n, p in net.named_parameters()}


def mpidist_optimizer(name: str):
    if name == "adam":
        return Adam(lr=1e-2, weight_decay=0.01)
    return SGD(lr=0.1, momentum=0.9, nesterov=True)


def run_mpidist(comm, strategy, optimizer, units=None, micro=1, loss=None, steps=STEPS):
    mesh = ProcessMesh(comm)
    config = ShardingConfiguration(mesh=mesh, dtype="float64", micro_batches=micro,
                                   bucket_mb=0.0005)
    net = make_net(seed=comm.Get_rank())  # rank 0's initial values must win (broadcast)
    if comm.Get_rank() == 0:
        net.load_state_dict(make_net().state_dict())
    trainer = wrap_torch(net, strategy, mpidist_optimizer(optimizer), config, units=units,
                         loss=loss)
    n, r = comm.Get_size(), comm.Get_rank()
    b = B // n
    losses = []
    for s in range(steps):
        x, y = data(s)
        losses.append(trainer.step((x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])))
    return np.array(losses), net, trainer


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
@pytest.mark.parametrize("units", [None, "children"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_matches_single_process_torch(comm, strategy, units, optimizer):
    ref_losses, ref_params = torch_reference(optimizer)
    losses, net, trainer = run_mpidist(comm, strategy, optimizer, units=units,
                                       micro=2 if units else 1)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=1e-12)
    for name, p in net.named_parameters():
        np.testing.assert_allclose(p.detach().numpy(), ref_params[name], rtol=1e-9,
                                   atol=1e-12, err_msg=name)
    # Parameters stay views into the flat buffer after training.
    for p in net.parameters():
        assert np.shares_memory(p.data.numpy(), trainer.model.params)
    trainer.free()


@pytest.mark.mpi(min_size=2)
def test_zero3_with_children_units(comm):
    ref_losses, ref_params = torch_reference("adam")
    losses, net, trainer = run_mpidist(comm, "zero3", "adam", units="children")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=1e-12)
    got = trainer.full_parameters()
    for name, ref in ref_params.items():
        np.testing.assert_allclose(got[name], ref, rtol=1e-9, atol=1e-12, err_msg=name)
    trainer.free()


@pytest.mark.mpi(min_size=2)
def test_torch_loss_matches_default_loss(comm):
    ref_losses, _ = torch_reference("adam")
    fn = TorchLoss(lambda o, t: torch.nn.functional.cross_entropy(o, t, reduction="sum"))
    losses, _, trainer = run_mpidist(comm, "zero2", "adam", loss=fn, micro=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=1e-12)
    trainer.free()


def test_single_process_and_views():
    ref_losses, ref_params = torch_reference("adam")
    net = make_net()
    trainer = wrap_torch(net, "ddp", Adam(lr=1e-2, weight_decay=0.01),
                         ShardingConfiguration(dtype="float64"))
    flat_p, flat_g = trainer.model.params, trainer.model.grads
    lo_p = flat_p.ctypes.data
    lo_g = flat_g.ctypes.data
    x, y = data(0)
    trainer.step((x, y))
    offset = 0
    for name, p in net.named_parameters():
        # .data and .grad point at this parameter's slice of the flat buffers: no copies.
        assert p.data.data_ptr() == lo_p + offset * 8, name
        assert p.grad.data_ptr() == lo_g + offset * 8, name
        np.testing.assert_array_equal(p.grad.numpy().ravel(),
                                      flat_g[offset:offset + p.numel()])
        offset += p.numel()
    for s in range(1, STEPS):
        trainer.step(data(s))
    for name, p in net.named_parameters():
        np.testing.assert_allclose(p.detach().numpy(), ref_params[name], rtol=1e-9, atol=1e-12)


def test_float32_training_from_float32_module():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(D_IN, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    trainer = wrap_torch(net, "zero1", SGD(lr=0.05), loss=_mse())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, D_IN))  # float64 inputs are cast to the parameter dtype
    y = x[:, :1] * 0.5
    first = trainer.step((x, y))
    for _ in range(30):
        last = trainer.step((x, y))
    assert net[0].weight.dtype == torch.float32
    assert last < first


def _mse():
    from mpidist.nn import MSELoss

    return MSELoss()


def test_initial_values_come_from_the_torch_module():
    net = make_net(seed=3)
    before = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
    trainer = wrap_torch(net, "zero2", "sgd", ShardingConfiguration(dtype="float64"))
    for name, arr in trainer.full_parameters().items():
        np.testing.assert_array_equal(arr, before[name])
    # wrapping the same torch module again starts from its current values
    again = wrap_torch(net, "ddp", "sgd", ShardingConfiguration(dtype="float64"))
    for name, arr in again.full_parameters().items():
        np.testing.assert_array_equal(arr, before[name])


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="nn.Module"):
        TorchModule(object())
    with pytest.raises(ValueError, match="Sequential"):
        TorchModule(torch.nn.Linear(2, 2), units="children")
    with pytest.raises(ValueError, match="units='layers'"):
        TorchModule(make_net(), units="layers")
    frozen = torch.nn.Linear(2, 2)
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        TorchModule(frozen)
    with pytest.raises(ValueError, match="strategy='zero9'"):
        wrap_torch(make_net(), "zero9")
    with pytest.raises(ValueError, match="units"):
        wrap_torch(make_net(), "zero3")  # one unit: ZeRO-3 needs units


def test_frozen_parameters_stay_outside_the_buffers():
    net = make_net()
    net[0].weight.requires_grad_(False)
    frozen = net[0].weight.detach().numpy().copy()
    trainer = wrap_torch(net, "ddp", SGD(lr=0.1), ShardingConfiguration(dtype="float64"))
    assert "0.weight" not in trainer.model.layout.names
    trainer.step(data(0))
    np.testing.assert_array_equal(net[0].weight.detach().numpy(), frozen)


def test_adapters_package_does_not_import_torch():
    code = "import sys, mpidist.adapters; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
