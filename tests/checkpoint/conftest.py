"""Fixtures of the checkpoint tests."""

from __future__ import annotations

import shutil
import tempfile

import pytest


@pytest.fixture
def shared_dir(comm):
    """One temporary directory for all ranks (``tmp_path`` differs per rank), removed
    after the test. Collective over ``comm``."""
    path = tempfile.mkdtemp(prefix="mpidist-ckpt-") if comm.rank == 0 else None
    path = comm.bcast(path, root=0)
    yield path
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
