"""Collective save/load under mpiexec: sharded writes, resharded reads, serial fallback,
and errors raised on every rank alike."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
from ckpt_helpers import (
    all_requests,
    empty_requests,
    full_values,
    model_tensors,
    sharded_pieces,
)

from mpidist.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    Piece,
    TensorInfo,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    read_pieces,
    read_tensor,
    save_checkpoint,
    verify_checkpoint,
)
from mpidist.checkpoint import save as ckpt_save

pytestmark = pytest.mark.mpi(min_size=2)


def _save(comm, directory, step=1, seed=0, **kw):
    values = full_values(seed)
    pieces = sharded_pieces(values, comm.size, comm.rank)
    attrs = {"step": step, "strategy": "zero1", "world_size": comm.size,
             "mesh": {"pp": 1, "dp": comm.size, "tp": 1}}
    path = save_checkpoint(checkpoint_path(directory, step), model_tensors(), pieces, attrs,
                           comm=comm, **kw)
    return path, values


def _check(reqs, values):
    for r in reqs:
        expect = values[r.name].ravel()[r.flat]
        assert r.data.tobytes() == expect.tobytes(), r.name


@pytest.mark.parametrize("mode", ["posix", "mpio", "serial"])
def test_sharded_save_resharded_load(comm, shared_dir, mode, monkeypatch):
    monkeypatch.setenv("MPIDIST_CHECKPOINT_IO", mode)
    serial = None
    used = []
    for fn in ("save_posix", "save_mpio", "save_serial"):
        real = getattr(ckpt_save, fn)
        monkeypatch.setattr(ckpt_save, fn,
                            lambda *a, _real=real, _fn=fn: used.append(_fn) or _real(*a))
    path, values = _save(comm, shared_dir, serial=serial)
    if mode == "mpio" and not h5py.get_config().mpi:
        mode = "posix"
    assert used == [f"save_{mode}"]
    assert os.path.exists(path) and latest_checkpoint(shared_dir) == path
    # Same sharding.
    reqs = empty_requests(comm.size, comm.rank)
    load_checkpoint(path, reqs, expected=model_tensors(), comm=comm, serial=serial)
    _check(reqs, values)
    # The layout of n-1 ranks (the last rank reads nothing): a shrink after a failure.
    m = comm.size - 1
    reqs = empty_requests(m, comm.rank) if comm.rank < m else []
    meta = load_checkpoint(path, reqs, expected=model_tensors(), comm=comm, serial=serial)
    assert meta["step"] == 1 and meta["world_size"] == comm.size
    _check(reqs, values)
    # The layout of n+1 ranks, rank 0 doing two ranks' worth: overlapping-free but uneven.
    m = comm.size + 1
    reqs = empty_requests(m, comm.rank) + (empty_requests(m, m - 1) if comm.rank == 0 else [])
    read_pieces(path, reqs, comm=comm, serial=serial)
    _check(reqs, values)
    # Every rank reads everything (replicated, DDP-style).
    reqs = all_requests()
    read_pieces(path, reqs, comm=comm, serial=serial)
    _check(reqs, values)
    # A serial reader on any rank sees the same tensors.
    name = "optimizer/exp_avg_sq/blocks.0.attn.qkv.weight"
    assert read_tensor(path, name).tobytes() == values[name].tobytes()
    comm.Barrier()
    if comm.rank == 0:
        verify_checkpoint(path, expected=model_tensors())


def test_serial_fallback_by_environment(comm, shared_dir, monkeypatch):
    monkeypatch.setenv("MPIDIST_CHECKPOINT_SERIAL", "1")
    path, values = _save(comm, shared_dir, step=3)
    reqs = empty_requests(comm.size, comm.rank)
    read_pieces(path, reqs, comm=comm)
    _check(reqs, values)
    monkeypatch.delenv("MPIDIST_CHECKPOINT_SERIAL")
    # The parallel writers produce the same tensors, checksums and layout.
    others = []
    for mode in ("posix", "mpio"):
        monkeypatch.setenv("MPIDIST_CHECKPOINT_IO", mode)
        other, _ = _save(comm, os.path.join(shared_dir, mode), step=3, serial=False)
        others.append(other)
    comm.Barrier()
    if comm.rank == 0:
        for other in others:
            with h5py.File(path) as a, h5py.File(other) as b:
                assert dict(a.attrs).keys() == dict(b.attrs).keys()
                for n in model_tensors():
                    assert a[n][...].tobytes() == b[n][...].tobytes()
                    assert dict(a[n].attrs) == dict(b[n].attrs)
                    assert a[n].id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS
                    assert b[n].id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS


@pytest.mark.parametrize("mode", ["posix", "mpio"])
def test_empty_and_unevenly_owned_tensors(comm, shared_dir, mode, monkeypatch):
    """Zero-size tensors, tensors written by one rank, ranks that write nothing."""
    monkeypatch.setenv("MPIDIST_CHECKPOINT_IO", mode)
    n, r = comm.size, comm.rank
    tensors = {"e/zero": TensorInfo((0, 4), "float32"), "e/scalar": TensorInfo((), "int32"),
               "only0": TensorInfo((5, 3), "float64"), "split": TensorInfo((n + 1, 3), "uint8")}
    split = np.arange(3 * (n + 1), dtype=np.uint8).reshape(n + 1, 3)
    pieces = [Piece("e/zero", slice(0, 0), np.empty(0, np.float32))]  # empty, every rank
    if r == 0:
        pieces.append(Piece("only0", slice(None), np.arange(15.0)))
    if r == n - 1:
        pieces.append(Piece("e/scalar", slice(0, 1), np.array([-7], np.int32)))
        pieces.append(Piece("split", slice(0, 2 * 3), split.ravel()[:6]))
    elif r == 1:  # rank 1 has everything else of "split"; ranks in between have none
        pieces.append(Piece("split", slice(6, split.size), split.ravel()[6:]))
    if n == 2 and r == 1:
        pieces = [p for p in pieces if p.name != "split"] + [
            Piece("split", slice(0, split.size), split.ravel())]
    path = save_checkpoint(os.path.join(shared_dir, "e.h5"), tensors, pieces, {"step": 0},
                           comm=comm)
    reqs = ([Piece("split", slice(r, r + 2), np.empty(2, np.uint8))]
            + ([Piece("e/scalar", slice(None), np.empty(1, np.int32))] if r == 0 else []))
    read_pieces(path, reqs, comm=comm)
    assert reqs[0].data.tolist() == split.ravel()[r:r + 2].tolist()
    if r == 0:
        assert reqs[1].data[0] == -7
    comm.Barrier()
    if r == 0:
        verify_checkpoint(path, expected=tensors)
        with h5py.File(path) as f:
            assert f["e/zero"].shape == (0, 4)
            np.testing.assert_array_equal(f["only0"][...], np.arange(15.0).reshape(5, 3))
            np.testing.assert_array_equal(f["split"][...], split)


def test_retention_and_latest_collective(comm, shared_dir):
    for step in (1, 2, 3, 4):
        _save(comm, shared_dir, step=step, seed=step, keep=2)
    comm.Barrier()
    names = sorted(f for f in os.listdir(shared_dir))
    assert names == ["ckpt-00000003.h5", "ckpt-00000004.h5", "latest"]
    reqs = empty_requests(comm.size, comm.rank)
    meta = read_pieces(shared_dir, reqs, comm=comm)
    assert meta["step"] == 4
    _check(reqs, full_values(4))


def test_mismatch_raises_on_every_rank(comm, shared_dir):
    path, _ = _save(comm, shared_dir)
    expected = dict(model_tensors())
    expected["params/head.w"] = TensorInfo((42,), "float32")
    with pytest.raises(CheckpointMismatchError, match="params/head.w"):
        load_checkpoint(path, empty_requests(comm.size, comm.rank), expected=expected,
                        comm=comm)
    # A bad request on one rank only: every rank raises, naming that rank.
    reqs = [Piece("params/nope", slice(0, 1), np.empty(1, np.float32))] if comm.rank == 1 else []
    with pytest.raises(CheckpointMismatchError, match=r"\[rank 1\].*params/nope"):
        read_pieces(path, reqs, comm=comm)


def test_corruption_raises_on_every_rank(comm, shared_dir):
    path, _ = _save(comm, shared_dir)
    name = "params/blocks.1.mlp.w"
    if comm.rank == 0:
        with h5py.File(path) as f:
            off, n = f[name].id.get_offset(), f[name].id.get_storage_size()
        with open(path, "r+b") as fh:
            fh.seek(off + n // 3)
            fh.write(b"\x7f")
    comm.Barrier()
    with pytest.raises(CorruptCheckpointError, match=name):
        read_pieces(path, empty_requests(comm.size, comm.rank), comm=comm)
    # Only the last rank requests the corrupted tensor, and only two elements of it.
    reqs = ([Piece(name, slice(5, 7), np.empty(2, np.float32))]
            if comm.rank == comm.size - 1 else [])
    with pytest.raises(CorruptCheckpointError, match=name):
        read_pieces(path, reqs, comm=comm)
    comm.Barrier()
    if comm.rank == 0:
        with open(path, "r+b") as fh:
            fh.truncate(os.path.getsize(path) // 2)
    comm.Barrier()
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupted"):
        read_pieces(path, empty_requests(comm.size, comm.rank), comm=comm)


def test_save_errors_raise_on_every_rank(comm, shared_dir):
    values = full_values()
    pieces = sharded_pieces(values, comm.size, comm.rank)
    target = os.path.join(shared_dir, "bad.h5")
    # One rank drops a piece: nobody writes, everybody raises.
    mine = pieces[1:] if comm.rank == comm.size - 1 else pieces
    with pytest.raises(CheckpointError, match="written by no rank"):
        save_checkpoint(target, model_tensors(), mine, {"step": 1}, comm=comm)
    # Ranks disagree on the metadata.
    with pytest.raises(CheckpointError, match=r"ranks \[1\] passed a different"):
        save_checkpoint(target, model_tensors(), pieces, {"step": 1 + (comm.rank == 1)},
                        comm=comm)
    # A local validation error on one rank.
    bad = [Piece(p.name, p.flat, p.data.astype(np.float64)) for p in pieces]
    mine = bad if comm.rank == 0 else pieces
    with pytest.raises(CheckpointError, match=r"\[rank 0\].*dtype float64"):
        save_checkpoint(target, model_tensors(), mine, {"step": 1}, comm=comm)
    comm.Barrier()
    assert os.listdir(shared_dir) == []


@pytest.mark.mpi(min_size=2)
def test_a_rank_0_step_raises_anything_on_every_rank(comm):
    """on_root: an exception class the checkpoint code does not expect (here IndexError,
    raised on rank 0 only) reaches every rank as a CheckpointError naming it, instead of
    leaving the other ranks waiting in the broadcast."""
    from mpidist.checkpoint import CheckpointError
    from mpidist.checkpoint.agreement import on_root

    def step():
        return [][comm.Get_rank()]

    with pytest.raises(CheckpointError, match=r"^\[rank 0\] reading: IndexError: list index"):
        on_root(comm, step, "reading")
    assert on_root(comm, lambda: comm.Get_rank() + 5) == 5
