"""inspect / export / diff / verify, and the files opening in the HDF5 command-line tools."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from ckpt_helpers import full_values, model_tensors, sharded_pieces

from mpidist.checkpoint import (
    CheckpointError,
    Piece,
    TensorInfo,
    diff,
    diff_found,
    export,
    format_diff,
    format_inspect,
    inspect,
    save_checkpoint,
    verify_checkpoint,
)


def save(path, seed=0, tensors=None, values=None, step=10):
    values = values if values is not None else full_values(seed)
    tensors = tensors or model_tensors()
    pieces = [Piece(n, slice(0, values[n].size), values[n].ravel()) for n in tensors]
    return save_checkpoint(path, tensors, pieces,
                           {"step": step, "strategy": "ddp", "mesh": [1, 2, 1], "world_size": 2,
                            "optimizer": {"type": "adam", "lr": 0.01}})


def test_inspect_report_and_text(tmp_path):
    values = full_values()
    path = save(tmp_path / "a.h5", values=values)
    rep = inspect(path, verify=True)
    json.dumps(rep)  # JSON-able for `mpidist inspect --json`
    assert rep["step"] == 10 and rep["strategy"] == "ddp" and rep["mesh"] == [1, 2, 1]
    assert rep["world_size"] == 2 and rep["verified"] is True
    assert rep["num_tensors"] == len(model_tensors())
    t = rep["tensors"]["params/blocks.1.mlp.w"]
    assert t["shape"] == [9, 17] and t["dtype"] == "float32"
    assert t["l2_norm"] == pytest.approx(np.linalg.norm(values["params/blocks.1.mlp.w"]),
                                         rel=1e-6)
    text = format_inspect(rep)
    assert "/optimizer/exp_avg  (" in text and "blocks.1.mlp.w" in text
    assert "step 10  strategy ddp" in text and "all checksums verified" in text
    assert inspect(path)["verified"] is False


def test_verify_report(tmp_path):
    path = save(tmp_path / "a.h5")
    rep = verify_checkpoint(path, expected=model_tensors())
    assert rep["ok"] and rep["step"] == 10
    assert rep["total_bytes"] == sum(i.nbytes for i in model_tensors().values())


def test_export_npz(tmp_path):
    values = full_values()
    path = save(tmp_path / "a.h5", values=values)
    keys = export(path, tmp_path / "p.npz")
    assert "blocks.0.attn.qkv.weight" in keys and len(keys) == len(model_tensors()) // 3
    with np.load(tmp_path / "p.npz") as z:
        assert sorted(z.files) == keys
        np.testing.assert_array_equal(z["head.w"], values["params/head.w"])
    with pytest.raises(ValueError, match=r"must end in \.npz"):
        export(path, tmp_path / "p.bin")


def test_export_safetensors(tmp_path):
    path = save(tmp_path / "a.h5")
    try:
        import safetensors  # noqa: F401
    except ImportError:
        with pytest.raises(CheckpointError, match="safetensors"):
            export(path, tmp_path / "p.safetensors")
        return
    from safetensors.numpy import load_file

    export(path, tmp_path / "p.safetensors")
    assert "head.w" in load_file(str(tmp_path / "p.safetensors"))


def test_diff(tmp_path):
    values = full_values()
    a = save(tmp_path / "a.h5", values=values)
    changed = {k: v.copy() for k, v in values.items()}
    changed["params/emb.bias"][2] += 0.5
    tensors = dict(model_tensors())
    tensors["params/extra"] = TensorInfo((2,), "float32")
    changed["params/extra"] = np.ones(2, np.float32)
    del tensors["params/head.w"]
    tensors["optimizer/exp_avg/head.w"] = TensorInfo((42,), "float32")
    changed["optimizer/exp_avg/head.w"] = np.zeros(42, np.float32)
    b = save(tmp_path / "b.h5", values=changed, tensors=tensors)
    d = diff(a, b)
    assert d["max_abs_diff"]["params/emb.bias"] == pytest.approx(0.5)
    assert d["max_abs_diff"]["params/emb.weight"] == 0.0
    assert d["differ"] == {"params/emb.bias": 1}
    assert d["only_in_a"] == ["params/head.w"] and d["only_in_b"] == ["params/extra"]
    assert "optimizer/exp_avg/head.w" in d["mismatched"]
    assert diff_found(d)
    lines = format_diff(d).splitlines()
    assert lines == [
        "params/emb.bias: max |a-b| = 0.5 (1 element(s) beyond the tolerance)",
        f"optimizer/exp_avg/head.w: {model_tensors()['optimizer/exp_avg/head.w'].shape} "
        "float32 vs (42,) float32",
        "params/head.w: only in a",
        "params/extra: only in b",
        "1 tensors differ, max abs diff 0.5, 1 shapes differ, 2 in one checkpoint only",
    ]
    # within a tolerance the values are the same; the shapes still differ
    assert diff(a, b, atol=0.5)["differ"] == {}
    assert diff(a, b, rtol=1e6)["differ"] == {}
    with pytest.raises(ValueError, match="atol=-1 must be a number >= 0"):
        diff(a, b, atol=-1)


def test_diff_tolerance_nan_and_identical(tmp_path):
    values = full_values()
    a = save(tmp_path / "a.h5", values=values)
    same = diff(a, save(tmp_path / "same.h5", values=values))
    assert not diff_found(same) and format_diff(same) == \
        "0 tensors differ, max abs diff 0, 0 shapes differ"
    changed = {k: v.copy() for k, v in values.items()}
    w = changed["params/emb.weight"].reshape(-1)
    w[0] = np.nan
    w[1] *= 1 + 1e-6
    b = save(tmp_path / "b.h5", values=changed)
    d = diff(a, b)
    assert d["differ"] == {"params/emb.weight": 2}
    assert d["max_abs_diff"]["params/emb.weight"] == np.inf
    # rtol covers the relative change, never the NaN
    assert diff(a, b, rtol=1e-5)["differ"] == {"params/emb.weight": 1}
    # a NaN on both sides (same bits) is no difference
    assert not diff_found(diff(b, save(tmp_path / "c.h5", values=changed)))


def test_sharded_save_looks_the_same(tmp_path):
    """A 3-rank sharding and a whole-tensor save give identical data and checksums."""
    values = full_values()
    a = save(tmp_path / "a.h5", values=values)
    pieces = [p for r in range(3) for p in sharded_pieces(values, 3, r)]
    b = save_checkpoint(tmp_path / "b.h5", model_tensors(), pieces, {"step": 10})
    assert all(v == 0.0 for v in diff(a, b)["max_abs_diff"].values())
    import h5py

    with h5py.File(a) as fa, h5py.File(b) as fb:
        for n in model_tensors():
            assert fa[n].attrs["checksum_s2"] == fb[n].attrs["checksum_s2"]


@pytest.mark.skipif(shutil.which("h5ls") is None, reason="h5ls (hdf5-tools) not on PATH")
def test_h5ls_and_h5dump(tmp_path):
    path = save(tmp_path / "a.h5")
    out = subprocess.run(["h5ls", "-r", path], capture_output=True, text=True, check=True)
    assert "/params/blocks.0.attn.qkv.weight Dataset {11, 3, 5}" in " ".join(out.stdout.split())
    assert "/optimizer/exp_avg_sq" in out.stdout
    if shutil.which("h5dump"):
        hdr = subprocess.run(["h5dump", "-H", path], capture_output=True, text=True, check=True)
        assert 'ATTRIBUTE "checksum_s1"' in hdr.stdout
        assert 'ATTRIBUTE "format_version"' in hdr.stdout
        attrs = subprocess.run(["h5dump", "-A", path], capture_output=True, text=True,
                               check=True)
        assert '"mpidist-checkpoint"' in attrs.stdout
