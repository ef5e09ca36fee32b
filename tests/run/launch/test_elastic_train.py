"""``--strategy elastic`` of the main job (the one loop of mpidist.run): a scale-up asked for
through ``<out>/elastic-target`` while training, with the losses of a fixed-size run."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from test_elastic_jobs import MPIEXEC, _env, _run

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "elastic_train_job.py")

pytestmark = [pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec"),
              pytest.mark.timeout(120)]


def _rows(path: Path, split: str = "train") -> dict[int, float]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("split") == split}


def test_train_elastic_grows_through_target_file(tmp_path: Path):
    fixed, elastic = tmp_path / "fixed", tmp_path / "elastic"
    _run([MPIEXEC, "-n", "2", sys.executable, JOB, str(fixed), "zero1", "0", "5"], _env())
    elastic.mkdir()
    (elastic / "elastic-target").write_text("4\n")  # read at the first step boundary
    _run([MPIEXEC, "-n", "2", sys.executable, JOB, str(elastic), "elastic", "1", "5"], _env())
    want, got = _rows(fixed / "metrics.jsonl"), _rows(elastic / "metrics.jsonl")
    assert sorted(got) == list(range(1, 6))
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-9), step
    assert _rows(elastic / "metrics.jsonl", "validation")[5] == \
        pytest.approx(_rows(fixed / "metrics.jsonl", "validation")[5], rel=1e-9)
    events = [json.loads(x) for x in (elastic / "events.jsonl").read_text().splitlines()]
    kinds = [(e["event"], e["step"], e["world_size"]) for e in events]
    assert ("join", 1, 4) in kinds and kinds[-1] == ("end", 5, 4)
    summary = json.loads((elastic / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["inner_strategy"] == "zero1"


def test_a_resize_commits_the_save_in_flight_first(tmp_path: Path):
    from mpidist.checkpoint import verify_checkpoint

    fixed, elastic = tmp_path / "fixed", tmp_path / "elastic"
    _run([MPIEXEC, "-n", "2", sys.executable, JOB, str(fixed), "zero1", "0", "5"], _env())
    elastic.mkdir()
    (elastic / "elastic-target").write_text("4\n")  # read at the first step boundary
    _run([MPIEXEC, "-n", "2", sys.executable, JOB, str(elastic), "elastic", "1", "5", "async"],
         _env())
    want, got = _rows(fixed / "metrics.jsonl"), _rows(elastic / "metrics.jsonl")
    assert sorted(got) == list(range(1, 6))
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-9), step
    events = [json.loads(x) for x in (elastic / "events.jsonl").read_text().splitlines()]
    join = [e for e in events if e["event"] == "join"]
    saves = {e["step"]: e for e in events if e["event"] == "checkpoint"}
    assert len(join) == 1 and join[0]["step"] == 1 and join[0]["world_size"] == 4
    # The step-1 save was in flight (its write takes a second) when the workers agreed to
    # grow: the two old workers committed it before anything moved, at the resize's step.
    assert saves[1]["asynchronous"] and saves[1]["commit_step"] == 1
    assert saves[1]["background_seconds"] >= 1.0 and saves[1]["world_size"] == 2
    assert saves[2]["asynchronous"] and saves[2]["world_size"] == 4  # then 4 writers
    assert sorted(saves) == [1, 2, 3, 4, 5]
    for step in (3, 4, 5):  # --keep 3
        verify_checkpoint(elastic / f"ckpt-{step:08d}.h5")
