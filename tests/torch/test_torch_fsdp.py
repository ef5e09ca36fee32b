"""mpidist.torch.fully_shard equals torch's fully_shard (FSDP2 on gloo) and single-process
training (float64, 1e-10), with sharded memory."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_models as M  # noqa: E402

from mpidist.torch import FSDPModule, clip_grad_norm_, fully_shard, gathered_bytes  # noqa: E402

STEPS = 10
GB = 24


def shard(model, comm, *, mine: bool, reshard: bool = True):
    if mine:
        for b in model.blocks:
            fully_shard(b, comm=comm, reshard_after_forward=reshard)
        fully_shard(model, comm=comm, reshard_after_forward=reshard)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh("cpu", (comm.Get_size(),))
        for b in model.blocks:
            torch_fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
        torch_fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def train(model, comm, accumulate: int = 1, clip: float | None = None, sgd: bool = False):
    rank, size = comm.Get_rank(), comm.Get_size()
    if sgd:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        x, y = M.batch("gpt", step, GB)
        x, y = M.local(x, rank, size), M.local(y, rank, size)
        opt.zero_grad()
        total = 0.0
        for i, (xs, ys) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate),
                                         strict=True)):
            if isinstance(model, FSDPModule) or hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(i == accumulate - 1)
            loss = M.loss_of("gpt", model, xs, ys) / accumulate
            loss.backward()
            total += loss.item()
        if clip is not None:
            if isinstance(model, FSDPModule):
                clip_grad_norm_(model, clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(comm.allreduce(total) / size)
    return np.array(losses)


def single_process(accumulate: int = 1, clip: float | None = None, sgd: bool = False):
    from mpi4py import MPI

    model = M.make("gpt")
    losses = train(model, MPI.COMM_SELF, accumulate, clip, sgd)
    return losses, M.params_of(model)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("reshard", [True, False])
def test_fully_shard_equals_torch_fully_shard(comm, reshard):
    M.gloo(comm)
    ours_model = shard(M.make("gpt"), comm, mine=True, reshard=reshard)
    ours = train(ours_model, comm)
    ref_model = shard(M.make("gpt"), comm, mine=False, reshard=reshard)
    ref = train(ref_model, comm)
    np.testing.assert_allclose(ours, ref, rtol=1e-10)
    M.assert_close(M.params_of(ours_model, comm), M.params_of(ref_model))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("accumulate,clip,sgd,overlap", [(1, None, False, "1"),
                                                         (2, None, False, "0"),
                                                         (1, 0.05, True, "1")])
def test_fully_shard_equals_single_process(comm, monkeypatch, accumulate, clip, sgd, overlap):
    monkeypatch.setenv("MPIDIST_TORCH_OVERLAP", overlap)  # prefetch and overlap, or blocking
    model = shard(M.make("gpt", seed=comm.Get_rank()), comm, mine=True)  # rank 0's values win
    losses = train(model, comm, accumulate, clip, sgd)
    ref_losses, ref_params = single_process(accumulate, clip, sgd)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
    M.assert_close(M.params_of(model, comm), ref_params)


@pytest.mark.mpi(min_size=2)
def test_fully_shard_memory_is_sharded(comm):
    """Parameters, gradients and Adam state per rank are ~1/N; at most the root and two
    blocks are gathered at once."""
    size = comm.Get_size()
    model = shard(M.make("gpt"), comm, mine=True)
    train(model, comm)
    total = sum(int(np.prod(p._mpidist_shard.shape)) for p in model.parameters())
    local = sum(p.numel() for p in model.parameters())
    rows = sum(p._mpidist_shard.shape[0] if p._mpidist_shard.shape else 1
               for p in model.parameters())
    assert local <= total / size + rows  # padding: at most one row per parameter
    everyone = comm.allgather(local)
    assert sum(everyone) == total
    gathered_bytes(model)  # resets the peak
    x, y = M.batch("gpt", 0, GB)
    M.loss_of("gpt", model, x[:size], y[:size]).backward()
    stats = gathered_bytes(model)
    unit = model.blocks[0]._mpidist_unit
    block = unit.size * unit.seg_numel * 8  # a block's all-gather, padding included
    assert stats["alive"] == 0
    assert stats["peak"] <= stats["root_unit"] + 2 * block


@pytest.mark.mpi(min_size=2)
def test_fully_shard_errors(comm):
    with pytest.raises(ValueError, match="already applied"):
        m = fully_shard(torch.nn.Linear(3, 3), comm=comm)
        fully_shard(m, comm=comm)
    d = 3 if comm.Get_rank() == 0 else 4
    with pytest.raises(ValueError, match="differ between ranks"):
        fully_shard(torch.nn.Linear(d, 2), comm=comm)
    tied = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 3), "b": torch.nn.Linear(3, 3)})
    tied["b"].weight = tied["a"].weight
    fully_shard(tied["a"], comm=comm)
    with pytest.raises(ValueError, match="tied to 'weight'"):
        fully_shard(tied, comm=comm)


@pytest.mark.mpi(min_size=3)
def test_fully_shard_rows_fewer_than_ranks(comm):
    """A parameter with fewer rows than ranks leaves some ranks an empty shard."""
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 2), torch.nn.Tanh(),
                                   torch.nn.Linear(2, 1)).double()

    model, plain = fully_shard(net(), comm=comm), net()
    shapes = comm.allgather([tuple(p.shape) for p in model.parameters()])
    assert any(s[0] == 0 for rank_shapes in shapes for s in rank_shapes)  # an empty shard
    x = torch.linspace(-1, 1, 60, dtype=torch.float64).reshape(12, 5)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    popt = torch.optim.Adam(plain.parameters(), lr=0.1)
    n, r = comm.Get_size(), comm.Get_rank()
    b = 12 // n
    for _ in range(3):
        opt.zero_grad()
        popt.zero_grad()
        model(x[r * b:(r + 1) * b]).mean().backward()
        opt.step()
        plain(x).mean().backward()
        popt.step()
    M.assert_close(M.params_of(model, comm), M.params_of(plain))


def test_fully_shard_is_superseded_by_torchs_own_on_the_backend():
    with pytest.warns(FutureWarning, match=r"torch.distributed.fsdp.fully_shard on the "
                                           r"'mpidist' backend"):
        fully_shard(torch.nn.Linear(2, 2), comm=None)
