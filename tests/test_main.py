"""``python -m mpidist`` (mpidist/__main__.py) is the ``mpidist`` command: the same output and
the same exit status as ``python -m mpidist.cli`` and the console script."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mpidist


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120)


def _commands() -> list[list[str]]:
    """Every way to start the command: both ``python -m`` forms, and the console script
    where it is installed next to this Python."""
    out = [[sys.executable, "-m", "mpidist"], [sys.executable, "-m", "mpidist.cli"]]
    script = Path(sys.executable).with_name("mpidist")
    if script.exists() or shutil.which("mpidist"):
        out.append([str(script if script.exists() else shutil.which("mpidist"))])
    return out


def test_python_m_mpidist_help():
    proc = _run(sys.executable, "-m", "mpidist", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: mpidist"), proc.stdout
    for command in ("train", "inspect", "plan", "env"):
        assert command in proc.stdout


def test_python_m_mpidist_version():
    proc = _run(sys.executable, "-m", "mpidist", "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["mpidist", mpidist.__version__]


@pytest.mark.parametrize("args", [["--help"], ["--version"], [], ["no-such-command"],
                                  ["inspect", "/nonexistent/ckpt.h5"]],
                         ids=["help", "version", "no-command", "bad-command", "bad-input"])
def test_every_entry_point_gives_the_same_output_and_status(args):
    results = [_run(*cmd, *args) for cmd in _commands()]
    first = results[0]
    if args in ([], ["no-such-command"]):
        assert first.returncode == 2
    if args == ["inspect", "/nonexistent/ckpt.h5"]:
        assert first.returncode != 0 and len(first.stderr.strip().splitlines()) == 1, first.stderr
    for cmd, proc in zip(_commands(), results, strict=True):
        assert (proc.returncode, proc.stdout, proc.stderr) == \
            (first.returncode, first.stdout, first.stderr), cmd
