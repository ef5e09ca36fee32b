"""`make run`'s path in a test-sized form: the commands of the Makefile's ``run`` recipe
(as ``make -n run`` prints them, with a smaller BPE, model and number of steps given
through its variables), run twice: the standard-library corpus prepared into a token file
with a byte-level BPE, the GPT trained on it (validation in bits per byte), a sample
decoded with the data's tokenizer; the second time the token file is reused as it is."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_env import cli_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.skipif(shutil.which("mpiexec") is None or shutil.which("make")
                                 is None, reason="needs mpiexec and make")]
TINY = "--n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --global-batch 8 " \
       "--eval-batches 1 --checkpoint-interval 0 --no-progress"


def _recipe(tmp_path: Path) -> list[list[str]]:
    """The commands of ``make run`` that make the data, train and sample."""
    venv = Path(sys.executable).parent.parent
    proc = subprocess.run(
        ["make", "-n", "-s", "-C", str(ROOT), "run", f"VENV={venv}", "NP=2",
         "RUN_VOCAB=300", f"RUN_DATA={tmp_path}/data/stdlib-bpe300.h5",
         f"RUN_OUT={tmp_path}/train", "RUN_STEPS=3", f"RUN_ARGS={TINY}",
         "-o", f"{venv}/.deps-ok", "-o", f"{venv}/.system-ok"],
        capture_output=True, text=True, timeout=60, check=True)
    keep = ("mkdir -p", "mpidist prepare", "mpidist train", "mpidist sample")
    return [shlex.split(line) for line in proc.stdout.splitlines()
            if any(k in line for k in keep)]


def _label(cmd: list[str]) -> str:
    if cmd[0] == "mkdir":
        return "mkdir"
    return cmd[[Path(w).name for w in cmd].index("mpidist") + 1]


def test_make_run_prepares_a_bpe_trains_samples_and_runs_again(tmp_path: Path):
    pytest.importorskip("tokenizers")
    commands = _recipe(tmp_path)
    assert [_label(c) for c in commands] == ["mkdir", "prepare", "train", "sample"]
    data = tmp_path / "data" / "stdlib-bpe300.h5"
    outputs = []
    for attempt in range(2):
        done = []
        for cmd in commands:
            proc = subprocess.run(["timeout", "-k", "5", "200", *cmd], env=cli_env(),
                                  capture_output=True, text=True, timeout=240)
            assert proc.returncode == 0, f"{cmd}:\n{proc.stdout}\n{proc.stderr}"
            done.append(proc.stdout)
        outputs.append(done)
        if attempt == 0:
            stamp = data.stat().st_mtime_ns
    first, again = outputs
    assert f"mpidist prepare: {data}: " in first[1] and "(bpe:300, vocabulary 300)" in first[1]
    assert f"mpidist prepare: {data}: reused (prepared before from the same inputs with " \
           "bpe:300)" in again[1]
    assert data.stat().st_mtime_ns == stamp  # kept as it was
    for out in (first, again):
        assert "validation bits/byte  " in out[2]
        assert out[3].startswith("def main(")
    summary = json.loads((tmp_path / "train" / "summary.json").read_text())
    assert summary["final_validation_bits_per_byte"] > 0
    assert summary["steps_done"] == 3
