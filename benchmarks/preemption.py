"""Preemption of `mpidist train`: signal -> checkpoint -> exit, against Slurm's KillWait.

    python benchmarks/preemption.py [-n 4] [--strategy zero2] [--n-layer 4 --n-embd 128]

Starts ``mpiexec -n N mpidist train`` (the default GPT unless flags say otherwise; no
periodic checkpoints), waits for its 5th step, sends SIGTERM to every rank, as srun does at
a time limit, and times:

* signal -> every rank exited (the whole preemption: finishing the step in progress, the
  agreement, the collective checkpoint, the exit), as a fraction of Slurm's default
  KillWait of 30 s, the time left before SIGKILL;
* the checkpoint write alone (from ``events.jsonl``), and the mean step time.

Then it times the agreement the loop runs between steps when nothing happened (one 8-byte
allreduce) against the mean step, in a second small MPI run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

KILL_WAIT = 30.0

AGREEMENT = """
import time
import numpy as np
from mpi4py import MPI
from mpidist.run.preempt import Preemption
comm, p = MPI.COMM_WORLD, Preemption([])
for _ in range(100):
    p.agreed(comm)
comm.Barrier()
t0 = time.perf_counter()
for _ in range(2000):
    p.agreed(comm)
dt = np.array([(time.perf_counter() - t0) / 2000])
comm.Allreduce(MPI.IN_PLACE, dt, op=MPI.MAX)
if comm.Get_rank() == 0:
    print(dt[0])
"""


def _rank_pids(tag: str) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes()
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"MPIDIST_BENCH_TAG={tag}".encode() in env.split(b"\0") \
                and b"mpidist.cli" in cmd and b"mpiexec" not in cmd[0]:
            out.append(int(proc.name))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=4, help="ranks (default 4)")
    ap.add_argument("--strategy", default="zero2")
    ap.add_argument("train_args", nargs="*", help="more `mpidist train` flags")
    args = ap.parse_args()
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        sys.exit("mpiexec not on PATH")
    tag = uuid.uuid4().hex
    env = dict(os.environ, MPIDIST_BENCH_TAG=tag, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [mpiexec, "-n", str(args.n), sys.executable, "-m", "mpidist.cli", "train",
               "--out", str(out), "--strategy", args.strategy, "--steps", "100000",
               "--checkpoint-interval", "0", "--eval-interval", "0", "--no-progress",
               *args.train_args]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        metrics = out / "metrics.jsonl"
        while proc.poll() is None and (not metrics.exists()
                                       or len(metrics.read_text().splitlines()) < 5):
            time.sleep(0.01)
        pids = _rank_pids(tag)
        t0, wall0 = time.perf_counter(), time.time()
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
        total = time.perf_counter() - t0
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
        events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    save = [e for e in events if e["event"] == "checkpoint"]
    pre = [e for e in events if e["event"] == "preempted"]
    if proc.returncode != 75 or not save or not pre:
        sys.exit(f"the run did not stop as preempted (exit {proc.returncode}):\n{err}")
    step = sum(r["seconds"] for r in rows[1:]) / max(1, len(rows) - 1)
    agree = subprocess.run([mpiexec, "-n", str(args.n), sys.executable, "-c", AGREEMENT],
                           env=env, capture_output=True, text=True, check=True)
    per_step = float(agree.stdout.strip())
    print(f"mpidist train --strategy {args.strategy} on {args.n} ranks "
          f"{' '.join(args.train_args)}: stopped after step {pre[0]['step']}, exit 75")
    print(f"signal -> all ranks exited   {total:7.2f} s   {total / KILL_WAIT:6.1%} of KillWait "
          f"({KILL_WAIT:.0f} s)")
    end = [e for e in events if e["event"] == "end"][-1]
    print(f"  signal -> checkpoint done  {pre[0]['time'] - wall0:7.2f} s")
    print(f"  checkpoint write           {save[-1]['seconds']:7.2f} s")
    print(f"  signal -> run ended        {end['time'] - wall0:7.2f} s   (then MPI and "
          "Python shut down)")
    print(f"  mean step                  {step:7.3f} s")
    print(f"agreement between steps     {per_step * 1e6:7.1f} us  {per_step / step:6.3%} of a "
          "step")


if __name__ == "__main__":
    main()
