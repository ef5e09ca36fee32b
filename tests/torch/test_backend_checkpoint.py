"""torch.distributed.checkpoint on the "mpidist" backend: save from FSDP2 at N ranks; load
into another mesh, into N-1 ranks and into one process; async_save while the main thread
keeps communicating."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch_models as M  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def sharded_mlp(mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = M.make_mlp()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(model, steps: int = 2) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = M.batch("mlp", step, 12)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return opt


def full_values(state: dict) -> dict[str, np.ndarray]:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update({f"{k}.{k2}": a for k2, a in full_values(v).items()})
        elif isinstance(v, torch.Tensor):
            t = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[k] = t.detach().numpy().copy()
    return out


def saved(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def trained_fsdp(n: int) -> tuple[torch.nn.Module, dict, dict[str, np.ndarray]]:
    """An FSDP2 model over every rank after two steps: the model, its state to save, and
    that state's full values."""
    from torch.distributed.device_mesh import init_device_mesh

    model = sharded_mlp(init_device_mesh("cpu", (n,)))
    state = saved(model, train(model))
    return model, state, full_values(state)


def assert_loads(model: torch.nn.Module, path: str, expected: dict[str, np.ndarray],
                 what: str, group=None) -> None:
    """``model`` (sharded some other way) and its optimizer load the checkpoint exactly.
    Collective over ``group`` (default every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    opt = train(model, steps=1)  # so that the optimizer has state to overwrite
    target = saved(model, opt)
    dcp.load(target, checkpoint_id=path, process_group=group)
    set_state_dict(model, opt, model_state_dict=target["model"],
                   optim_state_dict=target["optim"])
    M.assert_close(full_values(saved(model, opt)), expected, rtol=0, what=what)


def assert_loads_in_one_process(path: str, expected: dict[str, np.ndarray], what: str) -> None:
    """A plain module loads the checkpoint with no communication and gets its values."""
    import torch.distributed.checkpoint as dcp

    sd = M.make_mlp(seed=5).state_dict()
    dcp.load({"model": sd}, checkpoint_id=path, no_dist=True)
    M.assert_close({f"model.{k}": v.numpy() for k, v in sd.items()},
                   {k: v for k, v in expected.items() if k.startswith("model.")}, rtol=0,
                   what=what)


@pytest.mark.mpi(min_size=2)
def test_dcp_reshards_to_another_mesh_world_size_and_one_process(world, shared_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    rank, n = world
    _, state, expected = trained_fsdp(n)
    dcp.save(state, checkpoint_id=shared_dir)

    # another mesh: replicate x shard (HSDP) over the same ranks
    shape = (2, n // 2) if n % 2 == 0 else (1, n)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("rep", "shard"))
    assert_loads(sharded_mlp(mesh), shared_dir, expected, "other mesh")
    # another world size: the first n-1 ranks
    sub = dist.new_group(list(range(n - 1)))
    if rank < n - 1:
        model = sharded_mlp(DeviceMesh.from_group(sub, "cpu"))
        assert_loads(model, shared_dir, expected, f"{n - 1} ranks", group=sub)
    dist.barrier()
    assert_loads_in_one_process(shared_dir, expected, "one process")


@pytest.mark.mpi(min_size=2)
def test_async_save_while_the_main_thread_communicates(world, shared_dir):
    import torch.distributed.checkpoint as dcp

    rank, n = world
    model, state, expected = trained_fsdp(n)
    future = dcp.async_save(state, checkpoint_id=shared_dir)
    # Training goes on: collectives on the same group from the main thread while the save
    # thread runs its own (they travel on the group's second communicator).
    # (as many rounds as the save takes on rank 0, at least 200)
    # The same kinds of collectives as the save's (gathers and broadcasts).
    i, go = 0, torch.ones(1)
    while go.item():
        out = torch.empty(n, dtype=torch.float64)
        dist.all_gather_into_tensor(out, torch.full((1,), float(i + rank), dtype=torch.float64))
        assert out.tolist() == [float(i + r) for r in range(n)], f"round {i}: {out.tolist()}"
        b = torch.full((2,), float(i + rank))
        dist.broadcast(b, src=i % n)
        assert b.tolist() == [float(i + i % n)] * 2, f"round {i}: {b.tolist()}"
        i += 1
        if i % 20 == 0:
            go.fill_(float(i < 200 or not future.done()))
            dist.broadcast(go, src=0)
    train(model, steps=1)
    future.result()
    dist.barrier()
    assert_loads_in_one_process(shared_dir, expected, "async_save")


def tp_fsdp_mlp(n: int) -> torch.nn.Module:
    """The MLP with tensor parallelism over pairs of ranks (when n is even) and FSDP2 over
    the rest, every parameter a DTensor on the 2-D mesh."""
    tp = 2 if n % 2 == 0 else 1
    return M.tp_fsdp_mlp(n // tp, tp)[0]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("source", ["fsdp2", "tp+fsdp2"])
def test_mpidist_hdf5_checkpoints_of_dtensor_models(world, shared_dir, source):
    """mpidist.torch.save_checkpoint of a model sharded by torch's own parallelisms writes
    global named tensors: they load into the other torch layout, into mpidist's DDP and into
    a plain module in one process, and the file verifies."""
    from mpi4py import MPI
    from torch.distributed.device_mesh import init_device_mesh

    from mpidist.checkpoint import verify_checkpoint
    from mpidist.torch import DistributedDataParallel, load_checkpoint, save_checkpoint

    rank, n = world
    fsdp = lambda: sharded_mlp(init_device_mesh("cpu", (n,)))  # noqa: E731
    make = {"fsdp2": fsdp, "tp+fsdp2": lambda: tp_fsdp_mlp(n)}
    model = make[source]()
    opt = train(model)
    expected = full_values({"model": model.state_dict(), "optim": saved(model, opt)["optim"]})
    path = save_checkpoint(f"{shared_dir}/ckpt-00000002.h5", model, opt, step=2)
    if rank == 0:
        verify_checkpoint(path)
    other = make["tp+fsdp2" if source == "fsdp2" else "fsdp2"]()
    other_opt = train(other, steps=1)
    assert load_checkpoint(shared_dir, other, other_opt)["step"] == 2
    got = full_values({"model": other.state_dict(), "optim": saved(other, other_opt)["optim"]})
    M.assert_close(got, expected, rtol=0, what=f"{source} -> the other layout")
    ddp = DistributedDataParallel(M.make_mlp(seed=3))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    load_checkpoint(path, ddp, ddp_opt)
    M.assert_close({f"model.{k}": v.numpy() for k, v in ddp.module.state_dict().items()},
                   {k: v for k, v in expected.items() if k.startswith("model.")}, rtol=0,
                   what="mpidist DDP")
    plain = M.make_mlp(seed=4)
    load_checkpoint(path, plain, comm=MPI.COMM_SELF)
    M.assert_close({f"model.{k}": v.numpy() for k, v in plain.state_dict().items()},
                   {k: v for k, v in expected.items() if k.startswith("model.")}, rtol=0,
                   what="one process")
