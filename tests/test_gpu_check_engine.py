"""The pure logic of the GPU check's engine items (benchmarks/gpu_check_engine.py): reading
the losses of a run, comparing them, and the verdict on the speed measurements."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check_engine.py"
_SPEC = importlib.util.spec_from_file_location("gpu_check_engine", _PATH)
gce = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gce)


def _row(precision: str, engine: float = 90.0, torch: float = 100.0, diff: float = 1e-6):
    return {"precision": precision, "engine_tps": engine, "torch_tps": torch,
            "engine_ms": 1.0, "torch_ms": 1.0, "first_loss_diff": diff, "last_loss_diff": diff}


def test_loss_rows_keys_by_step_and_split(tmp_path):
    rows = [{"step": 1, "loss": 2.5, "split": "train", "lr": 0.1}, {"step": 1, "lr": 0.1},
            {"step": 2, "loss": 2.0}, {"step": 2, "loss": 2.25, "split": "validation"},
            {"step": 2, "loss": 1.75}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert gce.loss_rows(path) == {(1, "train"): 2.5, (2, "train"): 1.75,
                                   (2, "validation"): 2.25}


def test_max_rel_diff_over_the_keys_of_got():
    want = {(1, "train"): 2.0, (2, "train"): 4.0, (3, "train"): 1.0}
    assert gce.max_rel_diff({(1, "train"): 2.0}, want) == 0.0
    assert gce.max_rel_diff({(1, "train"): 2.0, (2, "train"): 4.4}, want) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="no counterpart"):
        gce.max_rel_diff({(9, "validation"): 1.0}, want)
    with pytest.raises(ValueError, match="no losses"):
        gce.max_rel_diff({}, want)


def test_last_error_skips_mpiexec_report():
    err = "Traceback ...\nValueError: bad n_head=3\n-----\nPrimary job terminated\n-----\n"
    assert gce.last_error(err) == "ValueError: bad n_head=3"
    assert gce.last_error("") == "(no output)"


def test_json_lines_pass_over_other_and_cut_lines():
    text = 'warning: x\n{"precision": "full", "engine_tps": 1}\n[1]\n{"precision": "mixed'
    assert gce.json_lines(text) == [{"precision": "full", "engine_tps": 1}]


def test_judge_speed_goal_and_required_precisions():
    assert gce.judge_speed([_row("full"), _row("mixed-bf16")], dry=False)[0] == "PASS"
    status, detail = gce.judge_speed([_row("full"), _row("mixed-bf16", engine=70.0)], False)
    assert status == "FAIL" and "0.70x" in detail and "below the goal" in detail
    status, detail = gce.judge_speed(
        [_row("full"), {"precision": "mixed-bf16", "refused": "ValueError: no bf16"},
         _row("mixed-fp16")], dry=False)
    assert status == "SKIP" and "refused it: ValueError: no bf16" in detail
    assert "mixed-fp16: engine" in detail


def test_judge_speed_losses_errors_and_dry_run():
    status, detail = gce.judge_speed([_row("full", diff=1e-2), _row("mixed-bf16")], False)
    assert status == "FAIL" and "losses differ" in detail
    status, detail = gce.judge_speed([_row("full"), {"precision": "mixed-bf16",
                                                     "error": "RuntimeError: oops"}], False)
    assert status == "FAIL" and "oops" in detail
    assert gce.judge_speed([], dry=False)[0] == "FAIL"
    # In a dry run the speed goal is not applied and float32 alone is required.
    status, detail = gce.judge_speed(
        [{"meta": "tiny"}, _row("full", engine=10.0),
         {"precision": "mixed-bf16", "refused": "ValueError: needs a GPU"}], dry=True)
    assert status == "PASS" and detail.startswith("dry run") and "[tiny]" in detail
