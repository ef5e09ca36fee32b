"""benchmarks/data.py at its smallest size: the script runs and prints every comparison."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_env import cli_env

pytest.importorskip("tokenizers")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "data.py"


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
def test_data_benchmark_runs_at_its_smallest_size(tmp_path: Path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smallest", "--dir", str(tmp_path),
                           "--json", str(tmp_path / "report.json")], env=cli_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "x encode_batch" in out and out.count("mpidist prepare -n") == 2
    assert out.count("first step after") == 3 and out.count("MiB; data") == 3
    assert (tmp_path / "report.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # its files removed
