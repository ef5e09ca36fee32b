"""Asynchronous saves in one process: the same file as a blocking save, the snapshot taken
before the call returns, the commit, the writer hook's failures and stops, abandoning,
two saves closer together than a write takes, and the I/O modes that stay blocking."""

from __future__ import annotations

import os
import threading
import time

import h5py
import pytest
from ckpt_helpers import all_requests, full_values, model_tensors, sharded_pieces

from mpidist.checkpoint import (
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    read_pieces,
    save_checkpoint,
    verify_checkpoint,
)
from mpidist.checkpoint.background import HostPool, default_pool, in_flight
from mpidist.checkpoint.writer import (
    HOOK_ENV,
    WRITER_POINTS,
    env_writer_hook,
    set_writer_hook,
)


@pytest.fixture(autouse=True)
def no_hook(monkeypatch):
    monkeypatch.delenv(HOOK_ENV, raising=False)
    set_writer_hook(None)
    yield
    set_writer_hook(None)
    pending = in_flight()
    if pending is not None:  # a failed test must not leave a save to the next one
        pending.abandon()


def pieces_of(values, n=3):
    return [p for r in range(n) for p in sharded_pieces(values, n, r)]


def start(directory, step, values, **kw):
    return save_checkpoint(checkpoint_path(directory, step), model_tensors(), pieces_of(values),
                           {"step": step}, async_=True, **kw)


def file_contents(path):
    """Every dataset's bytes and checksum attributes."""
    with h5py.File(path) as f:
        return {n: (f[n][()].tobytes(), int(f[n].attrs["checksum_s1"]),
                    int(f[n].attrs["checksum_s2"])) for n in model_tensors()}


def test_async_save_is_the_blocking_file_and_snapshots_before_returning(tmp_path):
    values = full_values(seed=3)
    blocking = save_checkpoint(tmp_path / "a" / "ckpt.h5", model_tensors(), pieces_of(values),
                               {"step": 7})
    pieces = pieces_of(values)
    handle = save_checkpoint(tmp_path / "b" / "ckpt.h5", model_tensors(), pieces, {"step": 7},
                             async_=True)
    for p in pieces:  # training changes the state as soon as the call returns
        p.data[...] = -1.0
    assert in_flight() is handle and not handle.committed
    assert latest_checkpoint(tmp_path / "b") is None  # nothing visible before the commit
    handle.wait(step=9)
    assert handle.committed and handle.commit_step == 9 and in_flight() is None
    assert handle.error is None and handle.done()
    assert file_contents(blocking) == file_contents(handle.path)
    verify_checkpoint(handle.path, expected=model_tensors())
    assert latest_checkpoint(tmp_path / "b") == handle.path
    assert handle.bytes == sum(i.nbytes for i in model_tensors().values())
    assert handle.local_bytes == handle.bytes  # one process writes everything
    assert set(handle.phase_seconds) == {"snapshot", "agreement", "layout", "start"}
    assert handle.blocking_seconds >= handle.phase_seconds["snapshot"] > 0
    assert not [n for n in os.listdir(tmp_path / "b") if n.startswith(".")]


def test_the_pool_is_reused_from_save_to_save(tmp_path):
    pool = HostPool()
    values = full_values()
    first = start(tmp_path, 1, values, pool=pool)
    buffer = pool.nbytes
    assert pool.busy and buffer >= first.local_bytes
    with pytest.raises(RuntimeError, match="still used by the save in flight"):
        pool.snapshot(pieces_of(values))
    first.wait()
    assert not pool.busy
    second = start(tmp_path, 2, values, pool=pool)
    assert pool.nbytes == buffer  # the same memory, not a new allocation
    second.wait()


def test_poll_commits_once_the_write_is_done(tmp_path):
    gate = threading.Event()
    set_writer_hook(lambda point, ctx: gate.wait() if point == "mid-write" else None)
    handle = start(tmp_path, 1, full_values())
    assert handle.poll(step=1) is False and not handle.done()  # still writing
    gate.set()
    deadline = time.monotonic() + 30
    while not handle.poll(step=2):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert handle.committed and latest_checkpoint(tmp_path) == handle.path


@pytest.mark.parametrize("point", WRITER_POINTS)
def test_a_write_failure_is_the_blocking_error_and_keeps_the_previous(tmp_path, point,
                                                                      monkeypatch):
    values = full_values()
    good = save_checkpoint(checkpoint_path(tmp_path, 1), model_tensors(), pieces_of(values),
                           {"step": 1})
    monkeypatch.setenv(HOOK_ENV, f"point={point},action=fail,step=2")
    with pytest.raises(CheckpointError) as blocking:
        save_checkpoint(checkpoint_path(tmp_path, 2), model_tensors(), pieces_of(values),
                        {"step": 2})
    handle = start(tmp_path, 2, values)
    with pytest.raises(CheckpointError) as background:
        handle.wait()
    assert str(background.value) == str(blocking.value)
    assert "OSError: [Errno 28] No space left on device" in str(blocking.value)
    assert f"at {point}" in str(blocking.value)
    assert handle.error is background.value and not handle.committed
    with pytest.raises(CheckpointError):  # asked again: the same error
        handle.wait()
    assert latest_checkpoint(tmp_path) == good
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001.h5", "latest"]  # no temp file
    verify_checkpoint(good)
    assert not default_pool().busy and in_flight() is None


def test_two_saves_closer_together_than_a_write_takes(tmp_path, monkeypatch):
    monkeypatch.setenv(HOOK_ENV, "point=mid-write,action=delay,seconds=0.3")
    values = [full_values(seed=s) for s in range(3)]
    t0 = time.perf_counter()
    handles = [start(tmp_path, s + 1, v, keep=2) for s, v in enumerate(values)]
    # Each save waited for the one before it (committed it) before starting.
    assert [h.committed for h in handles] == [True, True, False]
    assert time.perf_counter() - t0 >= 0.6
    handles[-1].wait()
    assert latest_checkpoint(tmp_path) == handles[-1].path
    assert sorted(n for n in os.listdir(tmp_path)) == ["ckpt-00000002.h5", "ckpt-00000003.h5",
                                                       "latest"]
    reqs = all_requests()
    read_pieces(handles[-1].path, reqs)
    assert all(r.data.tobytes() == values[2][r.name].tobytes() for r in reqs)
    # A blocking save waits for the save in flight too.
    handle = start(tmp_path, 4, values[0], keep=2)
    save_checkpoint(checkpoint_path(tmp_path, 5), model_tensors(), pieces_of(values[1]),
                    {"step": 5}, keep=2)
    assert handle.committed and latest_checkpoint(tmp_path).endswith("ckpt-00000005.h5")


def test_abandon_stops_the_writer_and_commits_nothing(tmp_path, monkeypatch):
    values = full_values()
    good = save_checkpoint(checkpoint_path(tmp_path, 1), model_tensors(), pieces_of(values),
                           {"step": 1})
    monkeypatch.setenv(HOOK_ENV, "point=mid-write,action=stop")
    handle = start(tmp_path, 2, values)
    deadline = time.monotonic() + 30
    while not [n for n in os.listdir(tmp_path) if n.startswith(".ckpt-00000002.h5.tmp-")]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    handle.abandon()
    assert handle.abandoned and handle.done() and not handle.committed
    assert in_flight() is None and not default_pool().busy
    handle.wait()  # nothing to do
    assert latest_checkpoint(tmp_path) == good
    temps = [n for n in os.listdir(tmp_path) if n.startswith(".")]
    assert len(temps) == 1  # the partial file: hidden, never listed as a checkpoint
    monkeypatch.delenv(HOOK_ENV)
    time.sleep(0.01)
    start(tmp_path, 3, values).wait()  # the next committed save deletes it
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_the_serial_mode_saves_before_returning(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIDIST_CHECKPOINT_IO", "serial")  # mpio: tests/checkpoint/test_ckpt_mpi
    values = full_values()
    handle = start(tmp_path, 1, values)
    assert handle.committed and handle.done() and in_flight() is None
    assert not default_pool().busy
    handle.wait()
    assert latest_checkpoint(tmp_path) == handle.path
    reqs = all_requests()
    read_pieces(handle.path, reqs)
    assert all(r.data.tobytes() == values[r.name].tobytes() for r in reqs)


def test_bad_arguments_raise_before_anything_is_written(tmp_path):
    values = full_values()
    pieces = pieces_of(values)[1:]  # a piece missing: not every element covered
    with pytest.raises(ValueError, match="written by no rank"):
        save_checkpoint(checkpoint_path(tmp_path, 1), model_tensors(), pieces, {"step": 1},
                        async_=True)
    assert not os.path.exists(tmp_path / "latest") and in_flight() is None
    assert not default_pool().busy
    with pytest.raises(CheckpointError, match="is neither a Piece"):
        save_checkpoint(checkpoint_path(tmp_path, 1), model_tensors(), [object()],
                        {"step": 1}, async_=True)


@pytest.mark.parametrize("spec, message", [
    ("point=middle,action=fail", "point='middle' is not one of"),
    ("point=mid-write,action=explode", "action='explode' is not one of"),
    ("point=mid-write", "action=None"),
    ("point=mid-write,action=fail,rank=one", "must be numbers"),
    ("mid-write:fail", r"expected point=P,action=A"),
    ("point=mid-write,action=fail,point=mid-write", r"each key once"),
])
def test_bad_hook_specs_name_the_value(spec, message):
    with pytest.raises(ValueError, match=message):
        env_writer_hook(spec)


def test_the_env_hook_acts_only_on_its_rank_and_step(tmp_path, monkeypatch):
    values = full_values()
    monkeypatch.setenv(HOOK_ENV, "point=before-write,action=fail,rank=1")
    start(tmp_path, 1, values).wait()  # one process is rank 0: not acted on
    monkeypatch.setenv(HOOK_ENV, "point=before-write,action=fail,step=3")
    start(tmp_path, 2, values).wait()
    with pytest.raises(CheckpointError, match="injected by MPIDIST_CHECKPOINT_WRITER_HOOK"):
        start(tmp_path, 3, values).wait()
    assert latest_checkpoint(tmp_path).endswith("ckpt-00000002.h5")
