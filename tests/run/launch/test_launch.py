"""Entry points: abort-on-failure, environment detection, the console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mpidist.run.launch.env import launcher_from_env

MPIEXEC = shutil.which("mpiexec")
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH")


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        OMP_NUM_THREADS="1",
    )
    return env


def mpirun(n: int, args: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [MPIEXEC, "-n", str(n), *args], env=mpi_env(), capture_output=True, text=True,
        timeout=timeout, **kw,
    )


@needs_mpiexec
def test_one_failing_rank_ends_the_whole_job_quickly():
    script = textwrap.dedent(
        """
        from mpi4py import MPI
        from mpidist.run.launch import abort_on_failure

        @abort_on_failure()
        def main():
            comm = MPI.COMM_WORLD
            if comm.Get_rank() == 2:
                raise RuntimeError("rank two is broken")
            comm.Barrier()  # the other ranks would wait here forever

        main()
        """
    )
    t0 = time.monotonic()
    proc = mpirun(4, [sys.executable, "-c", script], timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert elapsed < 30, f"took {elapsed:.1f} s"
    assert "[rank 2] RuntimeError: rank two is broken" in proc.stderr
    assert "[rank 2] aborting the MPI job" in proc.stderr


@needs_mpiexec
def test_failing_mpi_test_aborts_pytest_instead_of_hanging(tmp_path: Path):
    shutil.copy(Path(__file__).parents[2] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_fail.py").write_text(textwrap.dedent(
        """
        import pytest

        @pytest.mark.mpi(min_size=2)
        def test_fails_on_rank_one(comm):
            assert comm.Get_rank() != 1, "rank one fails"
            comm.Barrier()
        """
    ))
    t0 = time.monotonic()
    proc = mpirun(2, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                      "--with-mpi", "-o", "timeout=60", str(tmp_path)], timeout=90, cwd=tmp_path)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 60
    assert "[rank 1] FAILED" in proc.stderr


def test_launcher_from_env():
    assert launcher_from_env({})["launcher"] == "none"
    got = launcher_from_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert got["launcher"] == "openmpi" and got["rank"] == 3 and got["size"] == 4
    assert got["local_rank"] == 1
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
             "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_NNODES": "2", "SLURM_STEP_ID": "0"}
    got = launcher_from_env(slurm)
    assert (got["launcher"], got["rank"], got["local_size"], got["nodes"]) == ("slurm", 5, 4, 2)
    # A batch script's own shell is not a task of a step.
    del slurm["SLURM_STEP_ID"]
    assert launcher_from_env(slurm)["launcher"] == "none"
    got = launcher_from_env({"PMI_RANK": "2", "PMI_SIZE": "3"})
    assert (got["launcher"], got["rank"], got["size"]) == ("mpich", 2, 3)


def test_h5py_has_mpi():
    import h5py

    assert h5py.get_config().mpi, "h5py must be built against parallel HDF5"


def test_version_and_env_single_process():
    import mpidist

    out = subprocess.run([sys.executable, "-m", "mpidist.cli", "--version"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"mpidist {mpidist.__version__}"
    out = subprocess.run([sys.executable, "-m", "mpidist.cli", "env", "--json"],
                         capture_output=True, text=True, check=True).stdout
    info = json.loads(out)
    assert info["ranks"][0]["size"] == 1 and info["ranks"][0]["h5py_mpi"] is True


@needs_mpiexec
def test_env_and_demo_under_mpiexec(tmp_path: Path):
    proc = mpirun(3, [sys.executable, "-m", "mpidist.cli", "env", "--json"])
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert [r["rank"] for r in info["ranks"]] == [0, 1, 2]
    assert {r["size"] for r in info["ranks"]} == {3}
    assert len({r["pid"] for r in info["ranks"]}) == 3  # one process each (for dumps)
    assert info["launcher_env"]["launcher"] == "openmpi"
    table = mpirun(3, [sys.executable, "-m", "mpidist.cli", "env"])
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert any(line.split()[:4] == ["rank", "local", "host", "pid"] for line in lines)
    rows = [line.split() for line in lines if line.split()[:1] in (["0"], ["1"], ["2"])]
    assert len(rows) == 3 and len({int(row[3]) for row in rows}) == 3, table.stdout
    proc = mpirun(4, [sys.executable, "-m", "mpidist.cli", "demo", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert summary["world_size"] == 4 and summary["replicas_identical"]
    assert summary["buckets"] > 1


def test_layout_by_node_groups_ranks_by_host():
    from mpidist.run.launch.env import layout_by_node

    rows = [{"rank": 1, "host": "b"}, {"rank": 0, "host": "a"}, {"rank": 3, "host": "b"},
            {"rank": 2, "host": "a"}]
    assert layout_by_node(rows) == ["a: 2 rank(s) 0 2", "b: 2 rank(s) 1 3"]
