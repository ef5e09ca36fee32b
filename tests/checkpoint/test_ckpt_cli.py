"""`mpidist diff` as a user runs it (`python -m mpidist.cli`): the tensors that differ, a summary
line, and diff(1)'s exit status: 0 the same, 1 different, 2 trouble."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from ckpt_helpers import full_values, model_tensors
from test_ckpt_tools import save


def mpidist(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpidist.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_identical_checkpoints_exit_0_with_the_summary_only(tmp_path):
    values = full_values()
    a, b = save(tmp_path / "a.h5", values=values), save(tmp_path / "b.h5", values=values)
    proc = mpidist("diff", str(a), str(b))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "0 tensors differ, max abs diff 0, 0 shapes differ\n"


def test_different_checkpoints_exit_1_and_end_with_the_summary(tmp_path):
    values = full_values()
    a = save(tmp_path / "a.h5", values=values)
    changed = {k: v.copy() for k, v in values.items()}
    changed["params/emb.bias"][2] += 0.25
    changed["params/head.w"] *= 1 + 1e-7
    b = save(tmp_path / "b.h5", values=changed)
    proc = mpidist("diff", str(a), str(b))
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("params/emb.bias: max |a-b| = 0.25 (1 element(s)")
    assert lines[1].startswith("params/head.w: max |a-b| = ")
    assert lines[-1].startswith("2 tensors differ, max abs diff 0.25, 0 shapes differ")
    assert len(lines) == 3
    # within --rtol the rounding-level change is the same, the 0.25 is not
    proc = mpidist("diff", str(a), str(b), "--rtol", "1e-5")
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[-1] == "1 tensors differ, max abs diff 0.25, 0 shapes differ"
    proc = mpidist("diff", str(a), str(b), "--atol", "0.25", "--rtol", "1e-5")
    assert proc.returncode == 0
    assert proc.stdout == "0 tensors differ, max abs diff 0.25, 0 shapes differ\n"


def test_shapes_that_differ_exit_1(tmp_path):
    a = save(tmp_path / "a.h5")
    tensors = dict(model_tensors())
    values = full_values()
    tensors["params/head.w"] = type(tensors["params/head.w"])((3,), "float32")
    values["params/head.w"] = np.zeros(3, np.float32)
    b = save(tmp_path / "b.h5", values=values, tensors=tensors)
    proc = mpidist("diff", str(a), str(b), "--atol", "1e9")
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[-1].endswith(", 1 shapes differ")


def test_a_missing_checkpoint_is_one_line_and_status_2(tmp_path):
    a = save(tmp_path / "a.h5")
    proc = mpidist("diff", str(a), str(tmp_path / "nope.h5"))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "nope.h5" in proc.stderr and proc.stderr.startswith("mpidist diff: error: ")
    proc = mpidist("diff", str(a), str(a), "--rtol", "-1")
    assert proc.returncode == 2 and "rtol=-1.0 must be a number >= 0" in proc.stderr


def test_python_dash_m_mpidist_is_the_command():
    proc = mpidist("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("mpidist ")
    proc = mpidist("diff", "--help")
    assert proc.returncode == 0 and "--rtol" in proc.stdout
    assert "Exit status: 0 the same, 1 different, 2 trouble." in proc.stdout
