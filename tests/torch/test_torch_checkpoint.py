"""save_checkpoint/load_checkpoint across the three wrappers and world sizes: a run saved by
one wrapper continues under another (or unwrapped in one process) on the same trajectory."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_models as M  # noqa: E402

from mpidist.checkpoint import read_metadata, read_tensor, verify_checkpoint  # noqa: E402
from mpidist.torch import (  # noqa: E402
    DistributedDataParallel,
    ZeroRedundancyOptimizer,
    fully_shard,
    load_checkpoint,
    save_checkpoint,
)

GB = 24


def build(kind: str, comm):
    """(model to train, module to read parameters from, optimizer) for a wrapper."""
    model = M.make("gpt")
    if kind == "fsdp":
        for b in model.blocks:
            fully_shard(b, comm=comm)
        fully_shard(model, comm=comm)
        return model, model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    if kind == "plain":
        return model, model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    net = DistributedDataParallel(model, comm=comm)
    if kind == "zero":
        return net, model, ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW,
                                                    comm=comm, lr=3e-3, weight_decay=0.1)
    return net, model, torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.1)


def steps(net, opt, comm, first: int, last: int) -> list[float]:
    rank, size = comm.Get_rank(), comm.Get_size()
    losses = []
    for step in range(first, last):
        x, y = M.batch("gpt", step, GB)
        opt.zero_grad()
        loss = M.loss_of("gpt", net, M.local(x, rank, size), M.local(y, rank, size))
        loss.backward()
        opt.step()
        losses.append(comm.allreduce(loss.item()) / size)
    return losses


def reference() -> tuple[list[float], dict[str, np.ndarray]]:
    from mpi4py import MPI

    net, model, opt = build("plain", MPI.COMM_SELF)
    return steps(net, opt, MPI.COMM_SELF, 0, 6), M.params_of(model)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("saver,loader", [("fsdp", "ddp"), ("zero", "fsdp"), ("ddp", "zero")])
def test_checkpoint_across_wrappers_and_world_sizes(comm, shared_dir, saver, loader):
    """Save at 2 ranks, resume at every rank of the job and in one process."""
    from mpi4py import MPI

    ref_losses, ref_params = reference()
    rank = comm.Get_rank()
    two = comm.Split(0 if rank < 2 else 1, rank)
    path = f"{shared_dir}/ckpt-3.h5"
    if rank < 2:
        net, module, opt = build(saver, two)
        first = steps(net, opt, two, 0, 3)
        np.testing.assert_allclose(first, ref_losses[:3], rtol=1e-10)
        save_checkpoint(path, net, opt, step=3)
    two.Free()
    comm.Barrier()
    # every rank of the job, under another wrapper
    net, module, opt = build(loader, comm)
    attrs = load_checkpoint(shared_dir, net, opt)
    assert attrs["step"] == 3
    rest = steps(net, opt, comm, 3, 6)
    np.testing.assert_allclose(rest, ref_losses[3:], rtol=1e-10)
    M.assert_close(M.params_of(module, comm), ref_params)
    # one process, no wrapper at all
    if rank == 0:
        net, module, opt = build("plain", MPI.COMM_SELF)
        load_checkpoint(path, net, opt, comm=MPI.COMM_SELF)
        rest = steps(net, opt, MPI.COMM_SELF, 3, 6)
        np.testing.assert_allclose(rest, ref_losses[3:], rtol=1e-10)
        M.assert_close(M.params_of(module), ref_params)
        assert verify_checkpoint(path)["ok"]
        meta, infos = read_metadata(path)
        assert infos["params/wte.weight"].shape == (M.VOCAB, M.EMBD)
        assert "params/head.weight" not in infos  # tied: saved once, as torch names it
        assert infos["optimizer/exp_avg/blocks.0.mlp.0.weight"].shape == (3 * M.EMBD, M.EMBD)
        assert infos["optimizer/step/ln_f.bias"].shape == ()
        assert meta["step"] == 3
        assert read_tensor(path, "params/ln_f.weight").shape == (M.EMBD,)
        if shutil.which("h5ls"):
            out = subprocess.run(["h5ls", "-r", path], capture_output=True, text=True).stdout
            assert "/params/blocks.0.attn.in_proj_weight Dataset {48, 16}" in " ".join(out.split())
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_checkpoint_buffers_and_mismatch(comm, shared_dir):
    model = M.make("bn")
    net = DistributedDataParallel(model, comm=comm, find_unused_parameters=True)
    x, _ = M.batch("bn", 0, GB)
    net(x[:4])["logits"].sum().backward()
    save_checkpoint(f"{shared_dir}/bn.h5", net, step=1)
    fresh = M.make("bn", seed=5)
    load_checkpoint(f"{shared_dir}/bn.h5", fresh, comm=comm)
    M.assert_close({n: b.numpy() for n, b in fresh.named_buffers()},
                   {n: b.numpy() for n, b in model.named_buffers()}, rtol=0.0)
    M.assert_close(M.params_of(fresh), M.params_of(model), rtol=0.0)
    other = torch.nn.Linear(3, 3)
    from mpidist.checkpoint import CheckpointMismatchError

    with pytest.raises(CheckpointMismatchError):
        load_checkpoint(f"{shared_dir}/bn.h5", other, comm=comm)
    with pytest.raises(Exception, match="no optimizer state"):
        load_checkpoint(f"{shared_dir}/bn.h5", fresh,
                        torch.optim.SGD(fresh.parameters(), lr=0.1), comm=comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["fsdp", "zero"])
def test_async_save_is_the_state_of_the_call(comm, shared_dir, kind):
    """save_checkpoint(..., async_=True) returns while training goes on; the file is the
    blocking save's, and a fresh model loaded from it continues from the saved step."""
    import h5py

    from mpidist.checkpoint.background import in_flight

    ref_losses, _ = reference()
    net, module, opt = build(kind, comm)
    steps(net, opt, comm, 0, 3)
    blocking = save_checkpoint(f"{shared_dir}/blocking.h5", net, opt, step=3)
    handle = save_checkpoint(f"{shared_dir}/async.h5", net, opt, step=3, async_=True)
    assert in_flight() is handle or handle.committed
    steps(net, opt, comm, 3, 5)  # the parameters and the optimizer state change
    handle.wait()
    assert handle.committed and in_flight() is None
    comm.Barrier()
    if comm.Get_rank() == 0:
        with h5py.File(blocking) as a, h5py.File(handle.path) as b:
            names = []
            a.visit(lambda n: names.append(n) if isinstance(a[n], h5py.Dataset) else None)
            for n in names:
                assert a[n][()].tobytes() == b[n][()].tobytes(), n
                assert dict(a[n].attrs) == dict(b[n].attrs), n
    net, module, opt = build(kind, comm)
    assert load_checkpoint(handle.path, net, opt)["step"] == 3
    np.testing.assert_allclose(steps(net, opt, comm, 3, 6), ref_losses[3:], rtol=1e-10)
