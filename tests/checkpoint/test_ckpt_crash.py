"""Crash safety: SIGKILL ranks at random moments of a save; the previous checkpoint survives.

Each trial runs ``mpiexec -n 2`` on a script that commits checkpoint 1, prints ``ready``,
then saves a larger checkpoint 2. After a random delay the test kills the whole process
group, or one rank (then the group), with SIGKILL. Afterwards ``latest_checkpoint`` must
name a checkpoint that verifies: checkpoint 1, or checkpoint 2 if it was committed.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from mpidist.checkpoint import latest_checkpoint, read_metadata, verify_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRIALS = int(os.environ.get("MPIDIST_CRASH_TRIALS", "16"))

SCRIPT = r"""
import os, sys
import numpy as np
from mpi4py import MPI
from mpidist.checkpoint import Piece, TensorInfo, save_checkpoint, checkpoint_path

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
directory = sys.argv[1]

def save(step, numel):
    tensors = {f"params/w{i}": TensorInfo((numel // 7, 7), "float32") for i in range(3)}
    pieces = []
    for name, info in tensors.items():
        n = info.numel
        a, b = rank * n // size, (rank + 1) * n // size
        data = np.arange(a, b, dtype=np.float32) * step
        pieces.append(Piece(name, slice(a, b), data))
    save_checkpoint(checkpoint_path(directory, step), tensors, pieces, {"step": step},
                    comm=comm, keep=2)

save(1, 7 * 1000)
pids = comm.gather(os.getpid(), root=0)
if rank == 0:
    print("ready", *pids, flush=True)
save(2, 7 * 1_000_000)
if rank == 0:  # save_checkpoint returns on rank 0 only after the commit
    print("done", flush=True)
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    env.pop("MPIDIST_CHECKPOINT_SERIAL", None)
    return env


def _trial(directory: str, delay: float, kill_one: bool) -> tuple[int, bool]:
    proc = subprocess.Popen(
        ["mpiexec", "-n", "2", sys.executable, "-c", SCRIPT, directory],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=_env(),
        start_new_session=True,
    )
    pids = []
    done = False
    try:
        while not pids:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError("the save script ended before checkpoint 1 was ready")
            if line.startswith("ready"):
                pids = [int(x) for x in line.split()[1:]]
        time.sleep(delay)
        if kill_one:
            with _suppress():
                os.kill(random.choice(pids), signal.SIGKILL)
            time.sleep(0.2)
    finally:
        with _suppress():
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        done = "done" in out
    return proc.returncode, done


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return exc_type is not None and issubclass(exc_type, ProcessLookupError)


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
@pytest.mark.timeout(240)
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    rng = random.Random(1234)
    outcomes = {1: 0, 2: 0}
    leftovers = 0
    t0 = time.monotonic()
    for trial in range(TRIALS):
        directory = str(tmp_path / f"t{trial}")
        os.makedirs(directory)
        _, done = _trial(directory, delay=rng.uniform(0.0, 1.0), kill_one=trial % 2 == 1)
        latest = latest_checkpoint(directory)
        assert latest is not None, f"trial {trial}: no checkpoint survived"
        verify_checkpoint(latest)
        step = read_metadata(latest)[0]["step"]
        assert step in (1, 2)
        if done:
            assert step == 2, f"trial {trial}: checkpoint 2 committed but latest is {latest}"
        outcomes[step] += 1
        # Whatever is visible (not hidden) is complete; partial data lives only in temp files.
        for name in os.listdir(directory):
            if name.startswith("."):
                leftovers += 1
                continue
            assert name in ("latest", "ckpt-00000001.h5", "ckpt-00000002.h5"), name
            if name.endswith(".h5"):
                verify_checkpoint(os.path.join(directory, name))
    elapsed = time.monotonic() - t0
    print(f"\ncrash trials: {TRIALS} in {elapsed:.1f} s; latest was checkpoint 1 in "
          f"{outcomes[1]}, checkpoint 2 in {outcomes[2]}; {leftovers} temp files left behind")
