"""`mpidist train --data-blend` as a user runs it: the same losses at 1 and 3 ranks
(float64), a resume at another world size, the blend and its sources' hashes in the
checkpoint, a changed blend refused on resume in one line (nothing written) and accepted
with --data-reweight (the step continues, the new proportions are recorded)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from cli_env import cli_env, crashed_at

MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH")

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--global-batch", "11", "--dtype", "float64", "--eval-interval", "3",
        "--eval-batches", "2", "--no-progress", "--checkpoint-interval", "3", "--keep", "5"]


def mpidist(n: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mpidist.cli", *args]
    if n:
        cmd = ["timeout", "-k", "5", "200", MPIEXEC, "-q", "-n", str(n), *cmd]
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=240)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def losses(run: Path, split: str = "train") -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("split", "train") == split}


def meta(path: Path) -> dict:
    with h5py.File(path, "r") as f:
        return json.loads(f.attrs["metadata_json"])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("blend")
    texts = {"code": "def f(x):\n    return [x * i for i in range(9)]\n\n" * 120,
             "prose": "The cat sat on the mat; the dog did not.\n\n" * 130}
    out = {}
    for name, text in texts.items():
        (root / f"{name}.txt").write_text(text, encoding="utf-8")
        out[name] = root / f"{name}:1,2.h5"  # ':' and ',' in a path are no syntax
        mpidist(0, "prepare", str(root / f"{name}.txt"), "--out", str(out[name]),
                "--tokenizer", "bytes", "--separator", "\n\n", "--no-progress")
    return out


def test_a_blend_trains_alike_at_one_and_three_ranks(files, tmp_path):
    blend = ["--data-blend", "0.7", str(files["code"]), "0.3", str(files["prose"])]
    one, three = tmp_path / "one", tmp_path / "three"
    mpidist(0, "train", *blend, "--out", str(one), "--steps", "6", *TINY)
    mpidist(3, "train", *blend, "--out", str(three), "--steps", "6", *TINY)
    for split in ("train", "validation"):
        a, b = losses(one, split), losses(three, split)
        assert sorted(a) == sorted(b) and len(a) >= 2
        np.testing.assert_allclose([b[s] for s in sorted(b)], [a[s] for s in sorted(a)],
                                   rtol=1e-9)
    data = meta(three / "ckpt-00000006.h5")["extra"]["data"]
    with h5py.File(files["code"], "r") as f, h5py.File(files["prose"], "r") as g:
        hashes = [f.attrs["content_hash"], g.attrs["content_hash"]]
    assert data["kind"] == "blend" and data["hash"].startswith("sha256:")
    assert [(s["hash"], s["share"]) for s in data["sources"]] == list(zip(hashes, [0.7, 0.3],
                                                                          strict=True))
    assert meta(three / "ckpt-00000006.h5")["extra"]["train_config"]["data_blend"] == [
        [0.7, str(files["code"])], [0.3, str(files["prose"])]]
    # a crash after step 3, resumed on 2 ranks from the checkpoint alone (blend restored)
    part = crashed_at(one, 3, tmp_path / "part")
    mpidist(2, "train", "--out", str(part), "--steps", "6", "--resume", *TINY)
    a, b = losses(one), losses(part)
    np.testing.assert_allclose([b[s] for s in range(4, 7)], [a[s] for s in range(4, 7)],
                               rtol=1e-9)


def test_a_changed_blend_is_refused_on_resume_unless_reweighted(files, tmp_path):
    code, prose = str(files["code"]), str(files["prose"])
    run = tmp_path / "run"
    mpidist(2, "train", "--data-blend", "0.7", code, "0.3", prose, "--out", str(run),
            "--steps", "3", *TINY)
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    changed = ["--data-blend", "0.5", code, "0.5", prose]
    proc = mpidist(2, "train", *changed, "--out", str(run), "--steps", "6", "--resume",
                   *TINY, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"mpidist train: error: --data-blend 0.5 {files['code'].name} 0.5 "
        f"{files['prose'].name} is not the data checkpoint ckpt-00000003.h5 was trained on "
        f"(the blend 0.7 {files['code'].name} 0.3 {files['prose'].name}; weights "
        "normalized, sources compared by content hash): give the same blend, or "
        "--data-reweight to continue with the new proportions"]
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before
    # one file instead of the blend is refused alike
    proc = mpidist(0, "train", "--data", code, "--out", str(run), "--steps", "6",
                   "--resume", *TINY, check=False)
    assert proc.returncode == 2 and "is not the data checkpoint" in proc.stderr
    # the same weights scaled are the same blend
    mpidist(0, "train", "--data-blend", "7", code, "3", prose, "--out", str(run),
            "--steps", "4", "--resume", *TINY)
    proc = mpidist(2, "train", *changed, "--data-reweight", "--out", str(run), "--steps",
                   "6", "--resume", *TINY)
    assert (f"mpidist train: --data-reweight: the blend 0.5 {files['code'].name} 0.5 "
            f"{files['prose'].name} instead of the blend 0.7") in proc.stdout
    assert "resuming" in proc.stdout and "at step 4" in proc.stdout
    assert sorted(losses(run)) == list(range(1, 7))
    last = meta(run / "ckpt-00000006.h5")
    assert last["data"]["step"] == 6
    assert [s["share"] for s in last["extra"]["data"]["sources"]] == [0.5, 0.5]
    # and the new blend is the run's now: resuming without flags needs no switch
    mpidist(0, "train", "--out", str(run), "--steps", "7", "--resume", *TINY)
