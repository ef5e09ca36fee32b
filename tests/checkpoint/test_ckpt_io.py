"""Single-process save/load: round trip, atomic commit, retention, and every failure mode."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
from ckpt_helpers import all_requests, full_values, model_tensors, sharded_pieces

from mpidist import __version__
from mpidist.checkpoint import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    Piece,
    TensorInfo,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_metadata,
    read_pieces,
    read_tensor,
    save_checkpoint,
    verify_checkpoint,
)

ATTRS = {"step": 100, "strategy": "zero1", "mesh": {"pp": 1, "dp": 2, "tp": 1},
         "world_size": 2, "optimizer": {"type": "adamw", "lr": 3e-4, "betas": [0.9, 0.95]},
         "data": {"epoch": 1, "samples_seen": 12800}}


def save(directory, step=100, seed=0, n=3, keep=None, **kw):
    """Save a model as if from ``n`` ranks' shards (all pieces, one process)."""
    values = full_values(seed)
    pieces = [p for r in range(n) for p in sharded_pieces(values, n, r)]
    path = save_checkpoint(checkpoint_path(directory, step), model_tensors(), pieces,
                           dict(ATTRS, step=step), keep=keep, **kw)
    return path, values


def test_round_trip_and_metadata(tmp_path):
    path, values = save(tmp_path)
    assert os.path.basename(path) == "ckpt-00000100.h5"
    reqs = all_requests()
    meta = load_checkpoint(path, reqs, expected=model_tensors())
    for r in reqs:
        assert r.data.tobytes() == values[r.name].tobytes()
    assert meta["step"] == 100 and meta["optimizer"]["betas"] == [0.9, 0.95]
    assert meta["format"] == "mpidist-checkpoint" and meta["format_version"] == 1
    assert meta["library_version"] == __version__ and meta["created"].endswith("Z")
    attrs, tensors = read_metadata(path)
    assert tensors == model_tensors()
    with h5py.File(path) as f:  # plain h5py sees named global tensors and scalar attrs
        np.testing.assert_array_equal(f["params/blocks.0.attn.qkv.weight"][...],
                                      values["params/blocks.0.attn.qkv.weight"])
        assert f.attrs["step"] == 100 and f.attrs["strategy"] == "zero1"
    np.testing.assert_array_equal(read_tensor(path, "params/head.w"), values["params/head.w"])


def test_resharded_read_any_ranges(tmp_path):
    path, values = save(tmp_path, n=4)
    rng = np.random.default_rng(5)
    for name, info in model_tensors().items():
        for _ in range(3):
            a, b = sorted(int(x) for x in rng.integers(0, info.numel + 1, 2))
            out = np.empty(b - a, dtype=np.float32)
            read_pieces(path, [(name, slice(a, b), out)])
            np.testing.assert_array_equal(out, values[name].ravel()[a:b])


def test_directory_loads_latest(tmp_path):
    save(tmp_path, step=1, seed=1)
    _, values = save(tmp_path, step=2, seed=2)
    out = np.empty(5, dtype=np.float32)
    meta = read_pieces(tmp_path, [("params/emb.bias", slice(0, 5), out)])
    assert meta["step"] == 2
    np.testing.assert_array_equal(out, values["params/emb.bias"])


def test_latest_pointer_and_stale_temp(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    p1, _ = save(tmp_path, step=1)
    assert (tmp_path / "latest").read_text() == "ckpt-00000001.h5\n"
    assert latest_checkpoint(tmp_path) == p1
    # An interrupted save leaves a hidden temp file: ignored, then removed by the next save.
    stale = tmp_path / ".ckpt-00000002.h5.tmp-0123abcd"
    stale.write_bytes(b"\x89HDF partial")
    stale_latest = tmp_path / ".latest.tmp-deadbeef"
    stale_latest.write_text("ckpt-00000002.h5\n")
    os.utime(stale, (1, 1))
    os.utime(stale_latest, (1, 1))
    assert latest_checkpoint(tmp_path) == p1
    assert list_checkpoints(tmp_path) == [p1]
    p2, _ = save(tmp_path, step=2)
    assert latest_checkpoint(tmp_path) == p2
    assert not stale.exists() and not stale_latest.exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001.h5", "ckpt-00000002.h5", "latest"]


def test_latest_falls_back_without_pointer(tmp_path):
    save(tmp_path, step=5)
    p7, _ = save(tmp_path, step=7)
    os.remove(tmp_path / "latest")
    (tmp_path / "notes.h5").write_bytes(b"not hdf5")
    assert latest_checkpoint(tmp_path) == p7
    (tmp_path / "latest").write_text("ckpt-00000099.h5\n")  # dangling pointer
    assert latest_checkpoint(tmp_path) == p7


def test_retention_keeps_newest_k(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step=step, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000004.h5", "ckpt-00000005.h5", "latest"]
    (tmp_path / "other.h5").write_bytes(b"user file")  # not a checkpoint: never deleted
    save(tmp_path, step=6, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000006.h5", "latest", "other.h5"]
    with pytest.raises(CheckpointError, match="keep=0"):
        save(tmp_path, step=7, keep=0)


def test_retention_never_deletes_latest_target(tmp_path):
    save(tmp_path, step=1)
    save(tmp_path, step=2)
    (tmp_path / "latest").write_text("ckpt-00000001.h5\n")  # e.g. a user rolled back
    # Save a lower step: sorted by step the new one is oldest, but it is never deleted.
    save(tmp_path, step=0, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000000.h5", "ckpt-00000002.h5", "latest"]
    assert latest_checkpoint(tmp_path).endswith("ckpt-00000000.h5")


def _dataset_offset(path, name):
    with h5py.File(path) as f:
        return f[name].id.get_offset(), f[name].id.get_storage_size()


def test_corrupted_byte_names_dataset(tmp_path):
    path, _ = save(tmp_path)
    name = "optimizer/exp_avg/blocks.1.mlp.w"
    offset, nbytes = _dataset_offset(path, name)
    with open(path, "r+b") as fh:
        fh.seek(offset + nbytes // 2)
        byte = fh.read(1)
        fh.seek(offset + nbytes // 2)
        fh.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpointError, match=name):
        load_checkpoint(path, all_requests(), expected=model_tensors())
    with pytest.raises(CorruptCheckpointError, match=name):
        verify_checkpoint(path)
    # A partial load that touches the tensor also reads the rest of it to verify.
    out = np.empty(2, dtype=np.float32)
    with pytest.raises(CorruptCheckpointError, match=name):
        read_pieces(path, [(name, slice(0, 2), out)])
    # Other tensors stay loadable, and verify=False is an explicit opt-out.
    read_pieces(path, [("params/emb.bias", slice(0, 2), out)])
    read_pieces(path, [(name, slice(0, 2), out)], verify=False)


@pytest.mark.parametrize("keep_fraction", [0.0, 0.5, 0.97])
def test_truncated_file(tmp_path, keep_fraction):
    path, _ = save(tmp_path)
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.truncate(int(size * keep_fraction))
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupted"):
        load_checkpoint(path, all_requests(), expected=model_tensors())
    with pytest.raises(CorruptCheckpointError):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_metadata(tmp_path / "nope.h5")


def test_wrong_model_lists_differences(tmp_path):
    path, _ = save(tmp_path)
    expected = dict(model_tensors())
    del expected["params/emb.bias"]
    expected["params/new.weight"] = TensorInfo((3,), "float32")
    expected["params/head.w"] = TensorInfo((7, 6), "float32")
    expected["params/emb.weight"] = TensorInfo((13, 7), "float64")
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(path, [], expected=expected)
    msg = str(info.value)
    assert "missing from the checkpoint (1): params/new.weight" in msg
    assert "unexpected in the checkpoint (1): params/emb.bias" in msg
    assert "params/head.w: checkpoint has (3, 1, 2, 7) float32, expected (7, 6) float32" in msg
    assert "params/emb.weight: checkpoint has (13, 7) float32, expected (13, 7) float64" in msg
    with pytest.raises(CheckpointMismatchError, match="params/head.w"):
        verify_checkpoint(path, expected=expected)


def test_bad_requests(tmp_path):
    path, _ = save(tmp_path)
    with pytest.raises(CheckpointMismatchError, match="'params/nope'"):
        read_pieces(path, [("params/nope", slice(0, 1), np.empty(1, np.float32))])
    with pytest.raises(ValueError, match=r"\[0, 99\) is outside"):
        read_pieces(path, [("params/emb.bias", slice(0, 99), np.empty(99, np.float32))])
    with pytest.raises(ValueError, match="out dtype float64 differs"):
        read_pieces(path, [("params/emb.bias", slice(0, 5), np.empty(5))])


@pytest.mark.parametrize(("attr", "value", "match"), [
    ("format_version", 2, "format_version=2"),
    ("format", "something-else", "not an mpidist checkpoint"),
    ("checksum_algorithm", "crc32", "checksum_algorithm='crc32'"),
])
def test_other_format_or_version(tmp_path, attr, value, match):
    path, _ = save(tmp_path)
    with h5py.File(path, "r+") as f:
        f.attrs[attr] = value
    with pytest.raises(CheckpointFormatError, match=match):
        load_checkpoint(path, all_requests(), expected=model_tensors())
    with pytest.raises(CheckpointFormatError, match=match):
        read_metadata(path)


def test_not_hdf5(tmp_path):
    bogus = tmp_path / "x.h5"
    bogus.write_bytes(b"hello" * 100)
    with pytest.raises(CorruptCheckpointError, match="cannot be read as HDF5"):
        read_metadata(bogus)


def test_non_numeric_dataset_rejected(tmp_path):
    path, _ = save(tmp_path)
    with h5py.File(path, "r+") as f:
        f.create_dataset("params/evil", data=np.array([b"x"], dtype=object),
                         dtype=h5py.string_dtype())
    with pytest.raises(CorruptCheckpointError, match="non-numeric"):
        read_metadata(path)


def test_save_rejects_bad_pieces(tmp_path):
    values = full_values()
    tensors = model_tensors()
    pieces = sharded_pieces(values, 1, 0)
    target = tmp_path / "c.h5"
    with pytest.raises(CheckpointError, match="written by no rank"):
        save_checkpoint(target, tensors, pieces[1:])
    with pytest.raises(CheckpointError, match="written twice"):
        save_checkpoint(target, tensors, [*pieces, pieces[3]])
    with pytest.raises(CheckpointError, match="not in `tensors`"):
        save_checkpoint(target, tensors, [*pieces, Piece("x", slice(0, 1), np.zeros(1))])
    with pytest.raises(CheckpointError, match="data dtype float64 != float32"):
        p = pieces[0]
        save_checkpoint(target, tensors, [Piece(p.name, p.flat, p.data.astype(np.float64)),
                                          *pieces[1:]])
    with pytest.raises(CheckpointError, match="reserved"):
        save_checkpoint(target, tensors, pieces, {"format": 2})
    assert os.listdir(tmp_path) == []  # nothing written, no temp file left behind


def test_many_dtypes_round_trip(tmp_path):
    rng = np.random.default_rng(3)
    arrays = {
        "f16": rng.standard_normal((3, 5)).astype(np.float16),
        "f64": rng.standard_normal((4, 3)),
        "i8": rng.integers(-100, 100, (2, 9)).astype(np.int8),
        "u64": rng.integers(0, 2**63, (7,)).astype(np.uint64),
        "b": rng.integers(0, 2, (3, 3)).astype(bool),
        "c64": (rng.standard_normal(6) + 1j * rng.standard_normal(6)).astype(np.complex64),
        "nan": np.array([np.nan, -np.inf, -0.0, 1.0], dtype=np.float32),
    }
    tensors = {f"g/{k}": TensorInfo(v.shape, v.dtype.name) for k, v in arrays.items()}
    pieces = []
    for k, v in arrays.items():  # split each tensor into two ranges, mid-row
        m = v.size // 2 + 1
        pieces += [Piece(f"g/{k}", slice(0, m), v.ravel()[:m]),
                   Piece(f"g/{k}", slice(m, v.size), v.ravel()[m:])]
    path = save_checkpoint(tmp_path / "d.h5", tensors, pieces, {"step": 0})
    verify_checkpoint(path, expected=tensors)
    for k, v in arrays.items():
        assert read_tensor(path, f"g/{k}").tobytes() == v.tobytes()


def test_layout_contiguous_allocated_at_creation(tmp_path):
    """Every dataset has fixed contiguous storage: the posix writer and reader rely on it."""
    path, values = save(tmp_path)
    with h5py.File(path) as f:
        for name, info in model_tensors().items():
            ds = f[name]
            assert ds.id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS
            assert ds.id.get_create_plist().get_fill_time() == h5py.h5d.FILL_TIME_NEVER
            offset = ds.id.get_offset()
            assert offset is not None and ds.id.get_storage_size() == info.nbytes
            with open(path, "rb") as fh:  # the raw bytes at that offset are the tensor
                fh.seek(offset)
                raw = np.frombuffer(fh.read(info.nbytes), dtype="<f4")
            assert raw.tobytes() == values[name].astype("<f4").tobytes()
            assert ds.attrs["checksum_s1"].dtype == np.dtype("<u8")
            assert ds.attrs["checksum_s1"].shape == ()


def test_empty_scalar_and_unpieced_tensors(tmp_path):
    tensors = {"a/empty": TensorInfo((0,), "float32"), "a/empty2": TensorInfo((3, 0, 2), "int64"),
               "s": TensorInfo((), "float64"), "v": TensorInfo((7,), "int16")}
    v = np.arange(7, dtype=np.int16)
    # An empty piece of an empty tensor is allowed; empty tensors need no piece at all.
    pieces = [Piece("a/empty", slice(0, 0), np.empty(0, np.float32)),
              Piece("s", slice(0, 1), np.array([2.5])),
              Piece("v", slice(0, 0), v[:0]), Piece("v", slice(0, 7), v)]
    path = save_checkpoint(tmp_path / "e.h5", tensors, pieces, {"step": 0})
    verify_checkpoint(path, expected=tensors)
    assert read_tensor(path, "s") == 2.5 and read_tensor(path, "a/empty2").shape == (3, 0, 2)
    out_s, out_v, out_e = np.empty(1), np.empty(3, np.int16), np.empty(0, np.float32)
    read_pieces(path, [("s", slice(None), out_s), ("v", slice(2, 5), out_v),
                       ("a/empty", slice(0, 0), out_e), ("a/empty2", slice(0, 0),
                                                         np.empty(0, np.int64))])
    assert out_s[0] == 2.5 and out_v.tolist() == [2, 3, 4]
    with h5py.File(path) as f:
        assert f["s"][()] == 2.5 and f["a/empty2"].shape == (3, 0, 2)


def test_big_endian_pieces_and_outputs(tmp_path):
    """Data is stored little-endian whatever the byte order in memory."""
    x = np.arange(10, dtype=">f8") / 3
    tensors = {"x": TensorInfo((2, 5), "float64")}
    path = save_checkpoint(tmp_path / "b.h5", tensors, [Piece("x", slice(0, 10), x)])
    with h5py.File(path) as f:
        assert f["x"].dtype == np.dtype("<f8")
        np.testing.assert_array_equal(f["x"][...].ravel(), x)
    out = np.empty(6, dtype=">f8")
    read_pieces(path, [("x", slice(3, 9), out)])
    np.testing.assert_array_equal(out, x[3:9])


def test_reads_other_layouts_through_h5py(tmp_path):
    """Datasets another tool rewrote (chunked, compressed, big-endian) still load."""
    path, values = save(tmp_path)
    changed = {"params/emb.weight": {"chunks": (4, 7), "compression": "gzip"},
               "params/head.w": {"dtype": ">f4"},
               "optimizer/exp_avg/blocks.1.mlp.w": {"chunks": True}}
    with h5py.File(path, "r+") as f:
        for name, kw in changed.items():
            attrs = dict(f[name].attrs)
            data = f[name][...]
            del f[name]
            f.create_dataset(name, data=data, **kw)
            f[name].attrs.update(attrs)
    reqs = all_requests()
    load_checkpoint(path, reqs, expected=model_tensors())
    for r in reqs:
        assert r.data.tobytes() == values[r.name].tobytes(), r.name
    out = np.empty(9, dtype=np.float32)
    read_pieces(path, [("params/emb.weight", slice(40, 49), out)])
    np.testing.assert_array_equal(out, values["params/emb.weight"].ravel()[40:49])
    verify_checkpoint(path, expected=model_tensors())


def test_io_mode_environment(tmp_path, monkeypatch):
    from mpidist.checkpoint import save as ckpt_save

    used = []
    for mode in ("save_posix", "save_mpio", "save_serial"):
        real = getattr(ckpt_save, mode)
        monkeypatch.setattr(ckpt_save, mode,
                            lambda *a, _real=real, _mode=mode: used.append(_mode) or _real(*a))
    monkeypatch.setenv("MPIDIST_CHECKPOINT_IO", "lustre")
    with pytest.raises(CheckpointError, match="MPIDIST_CHECKPOINT_IO='lustre'"):
        save(tmp_path)
    with pytest.raises(CheckpointError, match="MPIDIST_CHECKPOINT_IO='lustre'"):
        read_pieces(tmp_path, [])
    assert os.listdir(tmp_path) == []
    for env, expect in (("mpio", "save_posix"),  # mpio needs more than one rank
                        ("serial", "save_serial"), ("POSIX", "save_posix"),
                        ("", "save_posix")):
        monkeypatch.setenv("MPIDIST_CHECKPOINT_IO", env)
        used.clear()
        _, values = save(tmp_path)
        assert used == [expect], env
        reqs = all_requests()
        read_pieces(tmp_path, reqs)
        assert all(r.data.tobytes() == values[r.name].tobytes() for r in reqs)
    used.clear()
    save(tmp_path, serial=False)  # serial=False overrides MPIDIST_CHECKPOINT_IO=serial
    monkeypatch.setenv("MPIDIST_CHECKPOINT_IO", "serial")
    save(tmp_path, serial=False)
    assert used == ["save_posix", "save_posix"]


def test_pread_past_end_is_corruption(tmp_path):
    from mpidist.checkpoint import storage as ckpt_io

    f = tmp_path / "short.bin"
    f.write_bytes(np.arange(4, dtype="<f4").tobytes())
    fd = os.open(f, os.O_RDONLY)
    try:
        out = np.empty(3, dtype=np.float32)
        ckpt_io.pread_array(fd, 4, out, np.dtype("<f4"), str(f))
        assert out.tolist() == [1, 2, 3]
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            ckpt_io.pread_array(fd, 8, out, np.dtype("<f4"), str(f))
    finally:
        os.close(fd)


def _checksum_attrs(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, dict(obj.attrs))
                     if isinstance(obj, h5py.Dataset) else None)
    return out


@pytest.mark.parametrize("compiled", [True, False])
def test_fused_checksums_and_writeback_match_serial(tmp_path, monkeypatch, compiled):
    """The posix mode checksums chunk by chunk while writing and patches the attributes
    afterwards; tiny chunks and writeback ranges give the serial mode's sums and bytes, in
    the compiled write loop and in the Python one (whose writeback calls are seen)."""
    from mpidist.checkpoint import storage as ckpt_io
    from mpidist.checkpoint import writer

    ref, values = save(tmp_path / "serial", serial=True)
    expect = _checksum_attrs(ref)
    monkeypatch.setattr(ckpt_io, "FUSED_CHUNK_BYTES", 12)  # 3 float32 / 1.5 float64
    calls = []
    real = ckpt_io.sync_file_range()
    if compiled:
        assert writer.native_writer() is not None
        real = None  # its sync_file_range calls are compiled code's
    else:
        monkeypatch.setattr(writer, "native_writer", lambda: None)
    if real is not None:
        monkeypatch.setattr(ckpt_io, "sync_file_range",
                            lambda: lambda *a: calls.append(a[1:3]) or real(*a))
    for mb in ("0", "0.00002", "32"):
        monkeypatch.setenv("MPIDIST_CHECKPOINT_WRITEBACK_MB", mb)
        calls.clear()
        path, _ = save(tmp_path / f"posix-{mb}", serial=False)
        assert _checksum_attrs(path) == expect, mb
        assert verify_checkpoint(path)
        reqs = all_requests()
        read_pieces(path, reqs)
        assert all(r.data.tobytes() == values[r.name].tobytes() for r in reqs)
        if real is not None:
            assert (len(calls) == 0) == (mb == "0"), (mb, len(calls))


@pytest.mark.parametrize("value", ["fast", "-1", "nan"])
def test_bad_writeback_setting(tmp_path, monkeypatch, value):
    monkeypatch.setenv("MPIDIST_CHECKPOINT_WRITEBACK_MB", value)
    with pytest.raises(CheckpointError, match=f"MPIDIST_CHECKPOINT_WRITEBACK_MB='{value}'"):
        save(tmp_path)
    assert not tmp_path.exists() or os.listdir(tmp_path) == []
