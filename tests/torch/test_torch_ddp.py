"""mpidist.torch.DistributedDataParallel equals torch's DDP on gloo (float64, 1e-10)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_models as M  # noqa: E402

from mpidist.torch import DistributedDataParallel  # noqa: E402

STEPS = 10
GB = 24  # divisible by 1, 2, 3 and 4 ranks, and by 2 micro-batches


def train(kind: str, wrap, comm, accumulate: int = 1, find_unused: bool = False):
    rank, size = comm.Get_rank(), comm.Get_size()
    model = M.make(kind, seed=rank)  # different on every rank: rank 0's values must win
    net = wrap(model)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        x, y = M.batch(kind, step, GB)
        x, y = M.local(x, rank, size), M.local(y, rank, size)
        opt.zero_grad()
        total = 0.0
        chunks = list(zip(x.chunk(accumulate), y.chunk(accumulate), strict=True))
        for i, (xs, ys) in enumerate(chunks):
            last = i == len(chunks) - 1
            ctx = net.no_sync() if not last else contextlib.nullcontext()
            with ctx:
                loss = M.loss_of(kind, net, xs, ys) / accumulate
                loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return np.array(losses), M.params_of(model), {n: b.numpy().copy()
                                                  for n, b in model.named_buffers()}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind,accumulate,overlap", [("gpt", 1, "1"), ("gpt", 2, "0"),
                                                     ("bn", 1, "0"), ("bn", 2, "1")])
def test_ddp_equals_torch_ddp(comm, monkeypatch, kind, accumulate, overlap):
    monkeypatch.setenv("MPIDIST_TORCH_OVERLAP", overlap)  # nonblocking buckets, or blocking
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    M.gloo(comm)
    unused = kind == "bn"
    ours = train(kind, lambda m: DistributedDataParallel(
        m, comm=comm, bucket_cap_mb=0.001, find_unused_parameters=unused), comm, accumulate)
    ref = train(kind, lambda m: TorchDDP(m, bucket_cap_mb=0.001,
                                         find_unused_parameters=unused), comm, accumulate)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-10)
    M.assert_close(ours[1], ref[1], what="params")
    M.assert_close(ours[2], ref[2], what="buffers")
    # every rank holds the same parameters
    everyone = comm.allgather(ours[1])
    for other in everyone[1:]:
        M.assert_close(other, everyone[0], rtol=0.0, what="replicas")


@pytest.mark.mpi(min_size=2)
def test_ddp_unused_parameter_without_flag_names_it(comm):
    net = DistributedDataParallel(M.make("bn"), comm=comm)
    x, y = M.batch("bn", 0, GB)
    loss = M.loss_of("bn", net, x[:4], y[:4])
    with pytest.raises(RuntimeError, match=r"unused\.weight.*find_unused_parameters=True"):
        loss.backward()


class _Cond(torch.nn.Module):
    def __init__(self, use_extra: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4).double()
        self.extra = torch.nn.Linear(4, 4).double()
        self.use_extra = use_extra

    def forward(self, x):
        y = self.lin(x)
        return y + self.extra(x) if self.use_extra else y


@pytest.mark.mpi(min_size=2)
def test_ddp_unused_on_some_ranks_only(comm):
    """A parameter used on rank 0 only gets rank 0's gradient divided by the size everywhere."""
    torch.manual_seed(0)
    model = _Cond(use_extra=comm.Get_rank() == 0)
    net = DistributedDataParallel(model, comm=comm, find_unused_parameters=True)
    net(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    extra = model.extra
    g = extra.weight.grad
    assert g is not None
    expected = torch.ones(4, 4, dtype=torch.float64) * 2 / comm.Get_size()
    torch.testing.assert_close(g, expected, rtol=0, atol=1e-15)


@pytest.mark.mpi(min_size=2)
def test_ddp_different_models_fail_on_every_rank(comm):
    d = 4 if comm.Get_rank() == 0 else 5
    model = torch.nn.Linear(d, 3)
    with pytest.raises(ValueError, match=r"differ between ranks.*rank 1"):
        DistributedDataParallel(model, comm=comm)


@pytest.mark.mpi(min_size=2)
def test_ddp_wrapped_twice_and_mixed_devices(comm):
    net = DistributedDataParallel(torch.nn.Linear(3, 3), comm=comm)
    with pytest.raises(ValueError, match="already wrapped"):
        DistributedDataParallel(net, comm=comm)
    with pytest.raises(ValueError, match="already wrapped"):
        DistributedDataParallel(net.module, comm=comm)
    mixed = torch.nn.Linear(3, 3)
    mixed.register_buffer("on_meta", torch.empty(2, device="meta"))
    with pytest.raises(ValueError, match="several devices"):
        DistributedDataParallel(mixed, comm=comm)


def test_ddp_single_process_is_plain_training():
    from mpi4py import MPI

    ours = train("gpt", lambda m: DistributedDataParallel(m, comm=MPI.COMM_SELF),
                 MPI.COMM_SELF)
    ref = train("gpt", lambda m: m, MPI.COMM_SELF)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-12)
    M.assert_close(ours[1], ref[1], rtol=1e-12)
