"""Launching torch scripts on the "mpidist" backend the way users do: under mpiexec with no
rendezvous variables, as plain python, with wrong variables, as srun without an MPI plugin
would; a failing or stalled rank ends the job; mixed backends; a gloo world with an mpidist
group. Each test starts its own job (no --with-mpi)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

MPIEXEC = shutil.which("mpiexec")
SCRIPT = str(Path(__file__).with_name("backend_launch.py"))
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH")
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS
           and not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "SLURM_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def run(mode: str, *args: str, n: int | None = 2, timeout: float = 120,
        **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, SCRIPT, mode, *args]
    if n is not None:
        cmd = [MPIEXEC, "-n", str(n), *cmd]
    return subprocess.run(cmd, env=clean_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def rows(proc: subprocess.CompletedProcess) -> list[dict]:
    """The JSON objects the ranks printed (their lines may interleave), by rank."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    decoder, text, out, i = json.JSONDecoder(), proc.stdout, [], 0
    while (i := text.find('{"rank"', i)) >= 0:
        row, i = decoder.raw_decode(text, i)
        out.append(row)
    return sorted(out, key=lambda r: r["rank"])


def test_mpiexec_needs_no_rendezvous_variables():
    got = rows(run("plain", n=3))
    assert [r["rank"] for r in got] == [0, 1, 2]
    for r in got:
        assert (r["size"], r["backend"], r["sum"]) == (3, "mpidist", 6.0)
        assert (r["big"], r["two_level"]) == (6.0, False)  # one node: the flat collective
        assert r["env"] == {"RANK": str(r["rank"]), "WORLD_SIZE": "3",
                            "LOCAL_RANK": str(r["rank"]), "LOCAL_WORLD_SIZE": "3"}
        assert r["store"] == "TCPStore"


def test_plain_python_is_a_world_of_one():
    (r,) = rows(run("plain", n=None))
    assert (r["rank"], r["size"], r["sum"]) == (0, 1, 1.0)


def test_variables_the_user_set_must_agree_with_mpi():
    proc = run("plain", RANK="5")
    assert proc.returncode != 0
    assert "rank=5 (argument or RANK) but MPI says" in proc.stderr
    with socket.socket() as s:  # a free port for the user's own MASTER_PORT
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    got = rows(run("plain", MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
    assert [r["sum"] for r in got] == [3.0, 3.0]


def test_srun_without_an_mpi_plugin_is_a_clear_error():
    # What each task of `srun -n 4` sees when srun has no MPI plugin: Slurm's step variables
    # and an MPI world of one.
    proc = run("plain", n=None, SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="4", SLURM_PROCID="2",
               SLURM_NTASKS="4")
    assert proc.returncode != 0
    assert "srun started 4 tasks but each is an MPI world of 1" in proc.stderr
    assert "srun --mpi=pmix" in proc.stderr
    proc = run("thin_layer", n=None, SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="4")
    assert proc.returncode != 0 and "--mpi=pmix" in proc.stderr


def test_a_failing_rank_ends_the_whole_job():
    t0 = time.monotonic()
    proc = run("fails", n=3, timeout=90)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 60
    assert "[rank 1] ValueError: rank one is broken" in proc.stderr
    assert "[rank 1] aborting the MPI job" in proc.stderr


def test_an_operation_past_the_group_timeout_ends_the_job_saying_where():
    t0 = time.monotonic()
    proc = run("stalls", timeout=90)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 45  # rank 1 sleeps 60 s
    assert "[rank 0] mpidist backend: all_reduce on group" in proc.stderr
    assert re.search(r"has not completed after \d s, past its group's timeout", proc.stderr)
    assert "in stalls" in proc.stderr  # the caller's line is shown


@pytest.mark.parametrize("config", ["cpu:mpidist,cuda:gloo", "cuda:gloo,cpu:mpidist"])
def test_part_of_a_mixed_backend(config):
    for r in rows(run("mixed", config)):
        assert r["config"] == config
        assert r["cpu"] == [1.0, 1.0] and r["other_sum"] == [2.0, 2.0]
        assert r["other"] == "ProcessGroupGloo" and "cpu" in r["devices"]


def test_an_mpidist_group_inside_a_gloo_world():
    for r in rows(run("in_gloo_world", n=3)):
        assert (r["world"], r["sub"]) == ("gloo", "mpidist")
        assert r["sum"] == [6.0] * 3 and r["gloo_sum"] == 3.0


def test_the_thin_layer_under_mpiexec():
    got = rows(run("thin_layer"))
    assert [(r["sum"], r["backend"]) for r in got] == [(2.0, "mpidist")] * 2
