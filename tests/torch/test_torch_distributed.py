"""mpidist.torch.distributed answers a script's torch.distributed calls from MPI."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import mpidist.torch.distributed as dist  # noqa: E402


@pytest.mark.mpi(min_size=2)
def test_process_group_calls(comm):
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())
    assert dist.is_initialized() and dist.is_available()
    assert (dist.get_rank(), dist.get_world_size()) == (comm.Get_rank(), comm.Get_size())
    t = torch.full((3,), float(dist.get_rank() + 1), dtype=torch.float64)
    dist.all_reduce(t)
    n = comm.Get_size()
    assert t.tolist() == [n * (n + 1) / 2] * 3
    t = torch.arange(4) * (dist.get_rank() + 1)
    dist.broadcast(t, src=1)
    assert t.tolist() == [0, 2, 4, 6]
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
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
