"""Fixtures of the torch tests."""

from __future__ import annotations

import shutil
import tempfile

import pytest


@pytest.fixture
def world(comm):
    """torch's default group on the "mpidist" backend over ``comm``: (rank, size)."""
    import torch.distributed as dist
    import torch_models as M

    M.use_backend("mpidist", comm)
    assert dist.get_backend() == "mpidist"
    return dist.get_rank(), dist.get_world_size()


@pytest.fixture
def shared_dir(comm):
    """A temporary directory made by rank 0, known to every rank, removed afterwards."""
    path = comm.bcast(tempfile.mkdtemp(prefix="mpidist-torch-") if comm.Get_rank() == 0
                      else None)
    yield path
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
