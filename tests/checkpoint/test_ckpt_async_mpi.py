"""Asynchronous saves under mpiexec: the blocking save's file at every I/O mode, a commit
polled until every rank is done, and one rank's write failure raised alike on every rank."""

from __future__ import annotations

import os
import threading
import time

import h5py
import pytest
from ckpt_helpers import empty_requests, full_values, model_tensors, sharded_pieces

from mpidist.checkpoint import (
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    read_pieces,
    save_checkpoint,
    verify_checkpoint,
)
from mpidist.checkpoint.background import in_flight
from mpidist.checkpoint.writer import set_writer_hook

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(autouse=True)
def _no_writer_hook_after():
    yield
    set_writer_hook(None)


def _contents(path):
    with h5py.File(path) as f:
        return {n: (f[n][()].tobytes(), int(f[n].attrs["checksum_s1"]),
                    int(f[n].attrs["checksum_s2"])) for n in model_tensors()}


@pytest.mark.parametrize("mode", ["posix", "mpio", "serial"])
def test_async_save_writes_the_blocking_file(comm, shared_dir, mode, monkeypatch):
    monkeypatch.setenv("MPIDIST_CHECKPOINT_IO", mode)
    values = full_values(seed=5)
    attrs = {"step": 3, "world_size": comm.size}
    blocking = save_checkpoint(os.path.join(shared_dir, "a", "ckpt.h5"), model_tensors(),
                               sharded_pieces(values, comm.size, comm.rank), attrs, comm=comm)
    pieces = sharded_pieces(values, comm.size, comm.rank)
    handle = save_checkpoint(os.path.join(shared_dir, "b", "ckpt.h5"), model_tensors(), pieces,
                             attrs, comm=comm, async_=True)
    for p in pieces:
        p.data[...] = 0.5
    assert handle.committed == (mode != "posix")
    handle.wait(step=4)
    assert handle.committed and in_flight() is None
    comm.Barrier()
    if comm.rank == 0:
        assert _contents(blocking) == _contents(handle.path)
        verify_checkpoint(handle.path, expected=model_tensors())
    # Any other layout reads it back.
    m = comm.size - 1
    reqs = empty_requests(m, comm.rank) if comm.rank < m else []
    read_pieces(handle.path, reqs, comm=comm)
    for r in reqs:
        assert r.data.tobytes() == values[r.name].ravel()[r.flat].tobytes(), r.name


def test_poll_commits_when_the_slowest_rank_is_done(comm, shared_dir):
    gate = threading.Event()
    if comm.rank == comm.size - 1:  # the last rank writes slowly
        set_writer_hook(lambda point, ctx: gate.wait() if point == "mid-write" else None)
    values = full_values()
    handle = save_checkpoint(checkpoint_path(shared_dir, 1), model_tensors(),
                             sharded_pieces(values, comm.size, comm.rank), {"step": 1},
                             comm=comm, async_=True)
    polls = 0
    while not handle.poll(step=polls):
        polls += 1
        if polls == 3:
            gate.set()
        assert polls < 3000
        time.sleep(0.01)
    assert polls >= 3  # not before the slow rank was let go
    assert handle.committed and handle.commit_step == comm.bcast(polls, root=0)
    assert latest_checkpoint(shared_dir) == handle.path


@pytest.mark.parametrize("point", ["before-write", "mid-write", "before-commit"])
def test_one_ranks_failure_is_every_ranks_error(comm, shared_dir, point, monkeypatch):
    values = full_values()
    pieces = sharded_pieces(values, comm.size, comm.rank)
    good = save_checkpoint(checkpoint_path(shared_dir, 1), model_tensors(), pieces,
                           {"step": 1}, comm=comm)
    victim = comm.size - 1
    if comm.rank == victim:
        monkeypatch.setenv("MPIDIST_CHECKPOINT_WRITER_HOOK", f"point={point},action=fail")
    with pytest.raises(CheckpointError) as blocking:
        save_checkpoint(checkpoint_path(shared_dir, 2), model_tensors(), pieces, {"step": 2},
                        comm=comm)
    # The other ranks' writers are slow (until stopped): the failure is known before they
    # finish, and stops them.
    if comm.rank != victim:
        set_writer_hook(lambda p, ctx: ctx.cancel.wait(60) if p == "mid-write" else None)
    handle = save_checkpoint(checkpoint_path(shared_dir, 2), model_tensors(), pieces,
                             {"step": 2}, comm=comm, async_=True)
    with pytest.raises(CheckpointError) as background:
        deadline = time.monotonic() + 60
        while not handle.poll():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert str(background.value) == str(blocking.value)
    assert str(blocking.value).startswith(f"[rank {victim}] OSError: [Errno 28]")
    comm.Barrier()
    assert latest_checkpoint(shared_dir) == good
    if comm.rank == 0:
        verify_checkpoint(good)
        assert sorted(os.listdir(shared_dir)) == ["ckpt-00000001.h5", "latest"]
