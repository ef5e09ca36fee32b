"""``optimizer.save(path, async_=True)``: training goes on while the state saved is the state
of the call; the save commits in a later ``step()`` once every rank's write is done (or in
``wait()`` / the next save), and a write failure raises the same error on every rank there.
Runs under mpiexec, at any number of ranks."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from strategy_helpers import make_case

from mpidist.checkpoint import CheckpointError, latest_checkpoint, read_metadata
from mpidist.checkpoint.background import in_flight
from mpidist.checkpoint.writer import set_writer_hook
from mpidist.core.mesh import ProcessMesh
from mpidist.parallel import STRATEGIES, ShardingConfiguration

B = 12


def _opt(comm, strategy: str):
    make_model, data, loss, make_opt = make_case("gpt")
    config = ShardingConfiguration(mesh=ProcessMesh(comm), dtype="float64")
    opt = STRATEGIES[strategy](make_opt(), config, loss=loss)
    return opt, opt.wrap(make_model(), seed=0), data


def _shared(comm, tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("async")) if comm.Get_rank() == 0 else None
    return comm.bcast(d)


@pytest.fixture(autouse=True)
def no_hook():
    yield
    set_writer_hook(None)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_training_goes_on_and_a_step_commits(comm, tmp_path_factory, strategy):
    directory = _shared(comm, tmp_path_factory)
    path = os.path.join(directory, "ckpt.h5")
    opt, model, data = _opt(comm, strategy)
    opt.optimize(model, data, 3, global_batch_size=B)
    gate = threading.Event()  # the write finishes only once training has gone on
    set_writer_hook(lambda point, ctx: gate.wait(60) if point == "mid-write" else None)
    handle = opt.save(path, async_=True)
    assert not handle.committed and in_flight() is handle
    opt.optimize(model, data, 2, global_batch_size=B)  # the steps poll: not done yet
    assert not handle.committed and latest_checkpoint(directory) is None
    gate.set()
    while not handle.committed:  # a step after every rank is done commits it
        opt.optimize(model, data, 1, global_batch_size=B)
        assert opt.step_count < 200
    assert handle.commit_step >= 5 and latest_checkpoint(directory) == path
    assert read_metadata(path)[0]["step"] == 3
    tail = opt.optimize(model, data, 3, global_batch_size=B).losses
    # A fresh optimizer loaded from the file continues from step 3, not from later.
    again, model2, _ = _opt(comm, strategy)
    again.load(path)
    assert again.step_count == 3
    again.optimize(model2, data, opt.step_count - 3 - 3, global_batch_size=B)
    np.testing.assert_array_equal(again.optimize(model2, data, 3, global_batch_size=B).losses,
                                  tail)


@pytest.mark.mpi(min_size=2)
def test_one_ranks_write_failure_raises_in_step_on_every_rank(comm, tmp_path_factory,
                                                              monkeypatch):
    directory = _shared(comm, tmp_path_factory)
    opt, model, data = _opt(comm, "zero2")
    opt.optimize(model, data, 1, global_batch_size=B)
    good = opt.save(os.path.join(directory, "ckpt-1.h5"))
    if comm.rank == 1:
        monkeypatch.setenv("MPIDIST_CHECKPOINT_WRITER_HOOK", "point=mid-write,action=fail")
    handle = opt.save(os.path.join(directory, "ckpt-2.h5"), async_=True)
    with pytest.raises(CheckpointError, match=r"^\[rank 1\] OSError: \[Errno 28\]"):
        for _ in range(200):
            opt.optimize(model, data, 1, global_batch_size=B)
    assert handle.error is not None and in_flight() is None
    comm.Barrier()
    assert latest_checkpoint(directory) == good
    opt.optimize(model, data, 1, global_batch_size=B)  # training can go on after it
