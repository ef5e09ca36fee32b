"""reuse_freed_memory: freed step memory is reused instead of faulted in afresh (glibc)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from mpidist.nn import reuse_freed_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# Three 16 MiB arrays made and freed per "step": with glibc's defaults their pages go back
# to the system after each step and are faulted in again in the next.
SCRIPT = """
import resource, sys
import numpy as np
from mpidist.nn import reuse_freed_memory

applied = reuse_freed_memory() if sys.argv[1] == "1" else None
def step():
    arrays = [np.ones(4 * 2**20, np.float32) for _ in range(3)]
    return sum(float(a[0]) for a in arrays)
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def run(flag: str, **env: str) -> tuple[str, float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, flag], env={**clean, **env},
                         capture_output=True, text=True, check=True, timeout=120).stdout
    applied, faults = out.split()
    return applied, float(faults)


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
def test_freed_memory_is_reused() -> None:
    _, faults_default = run("0")
    applied, faults = run("1")
    assert applied == "True"
    assert faults_default > 500  # pages given back and faulted in again every step
    assert faults < 50


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
def test_glibc_variables_win() -> None:
    applied, _ = run("1", MALLOC_MMAP_THRESHOLD_="65536")
    assert applied == "False"


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_retain_bytes(bad: object) -> None:
    with pytest.raises(ValueError, match="retain_bytes"):
        reuse_freed_memory(bad)  # type: ignore[arg-type]
