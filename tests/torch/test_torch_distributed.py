"""mpidist.torch.distributed is torch.distributed on the "mpidist" backend: old scripts'
calls (``init_process_group(comm=...)``, ``get_comm()``, mpi4py communicators as groups)
keep working, and every other name is torch's own."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as torch_dist  # noqa: E402

import mpidist.torch.distributed as dist  # noqa: E402


def _fresh() -> None:
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


@pytest.mark.mpi(min_size=2)
def test_process_group_calls(comm):
    _fresh()
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())
    assert dist.is_initialized() and dist.is_available() and torch_dist.is_initialized()
    assert torch_dist.get_backend() == "mpidist"  # the layer always runs on MPI
    # the same communicator (MPI handle), as mpidist's traced wrapper of it
    assert dist.get_comm() == comm and dist.get_comm() is dist.get_comm()
    assert (dist.get_rank(), dist.get_world_size()) == (comm.Get_rank(), comm.Get_size())
    t = torch.full((3,), float(dist.get_rank() + 1), dtype=torch.float64)
    dist.all_reduce(t)
    n = comm.Get_size()
    assert t.tolist() == [n * (n + 1) / 2] * 3
    t = torch.arange(4) * (dist.get_rank() + 1)
    dist.broadcast(t, src=1)
    assert t.tolist() == [0, 2, 4, 6]
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(t, op="max")
    work = dist.all_reduce(t, op=torch_dist.ReduceOp.SUM, async_op=True)
    work.wait()
    assert t.tolist() == [0, 2 * n, 4 * n, 6 * n]
    out = [torch.empty(1) for _ in range(n)]
    dist.all_gather(out, torch.ones(1) * dist.get_rank())  # torch's own, through the layer
    assert [o.item() for o in out] == list(range(n))
    dist.barrier()
    sampler = dist.DistributedSampler(list(range(10)), shuffle=False)
    from torch.utils.data.distributed import DistributedSampler

    expected = DistributedSampler(list(range(10)), num_replicas=n, rank=comm.Get_rank(),
                                  shuffle=False)
    assert list(sampler) == list(expected)
    dist.destroy_process_group()
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="world_size=99"):
        dist.init_process_group("gloo", world_size=99)


@pytest.mark.mpi(min_size=3)
def test_a_sub_communicator_as_the_world(comm):
    _fresh()
    rank = comm.Get_rank()
    sub = comm.Split(0 if rank < 2 else 1, rank)
    try:
        if rank < 2:
            dist.init_process_group(comm=sub)
            assert dist.get_world_size() == 2 and dist.get_rank() == rank
            t = torch.ones(2)
            dist.all_reduce(t)
            assert t.tolist() == [2.0, 2.0]
            g = dist.new_group([1])
            if rank == 1:
                x = torch.ones(1) * 5
                dist.all_reduce(x, group=g)
                assert x.item() == 5
            dist.destroy_process_group()
        # an mpi4py communicator as the group of an operation runs it on MPI directly
        t = torch.ones(1, dtype=torch.float64)
        dist.all_reduce(t, group=sub)
        assert t.item() == sub.Get_size()
        assert dist.get_rank(sub) == sub.Get_rank()
    finally:
        sub.Free()
    # torch's own init_process_group afterwards is on every rank again, not on the freed sub
    import torch.distributed as torch_dist

    torch_dist.init_process_group("mpidist")
    try:
        assert torch_dist.get_world_size() == comm.Get_size()
    finally:
        torch_dist.destroy_process_group()
