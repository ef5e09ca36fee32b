"""A hung job, end to end: a rank held before a collective (``MPIDIST_TEST_HOLD``) or stopped
from outside (SIGSTOP: its watchdog cannot run, the others' can), in ``mpidist train`` and in
a torch script on the "mpidist" backend. Every rank that can dumps its flight recorder within
the hang timeout plus a few seconds, and ``mpidist doctor`` names exactly that rank (with its
stack where it dumped) and the collective the others wait in; a healthy run's dumps (SIGUSR2
to every rank) give "nothing wrong", exit status 0.

These tests start mpiexec themselves (under ``timeout``): they are not mpi-marked. ``make
test`` runs one case of each kind; ``make test-hang`` (``MPIDIST_TEST_HANG=1``) the whole
matrix: 3 and 4 ranks x engine and torch x held and stopped, and the healthy runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from cli_env import cli_env

MPIEXEC = shutil.which("mpiexec")
HANG_TIMEOUT = 4.0
SLACK = 12.0  # seconds past the hang timeout by which the dumps must exist (2 busy cores)
FULL = os.environ.get("MPIDIST_TEST_HANG") == "1"
# (kind, how, ranks) in `make test`; the rest in `make test-hang`
QUICK = {("engine", "hold", 3), ("torch", "stop", 4), ("engine", "healthy", 3)}
ABORT_GRACE = 5.0  # the watchdog's wait after its dump before it aborts (at least 5 s)
TORCH_SCRIPT = Path(__file__).with_name("hang_torch.py")
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--global-batch", "12", "--eval-interval", "0", "--checkpoint-interval", "0",
        "--no-progress", "--steps", "1000000"]
# where the engine's rank is held: (strategy, phase) by size
ENGINE_HOLD = {3: ("ddp", "backward"), 4: ("zero3", "forward")}
HOLD_STEP = {"engine": 3, "torch": 5}


def _case(kind: str, how: str, n: int) -> pytest.param:
    quick = (kind, how, n) in QUICK
    marks = [pytest.mark.timeout(240)]
    if kind == "torch":
        marks.append(pytest.mark.skipif(
            subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
            .returncode != 0, reason="needs torch"))
    if not (quick or FULL):
        marks.append(pytest.mark.skip(reason="make test-hang runs the whole matrix"))
    return pytest.param(kind, how, n, marks=marks, id=f"{kind}-{how}-{n}")


class Job:
    """One ``mpiexec -n n`` job (engine: ``mpidist train``; torch: ``hang_torch.py``)
    started in the background, its ranks found by a tag in their environment."""

    def __init__(self, tmp: Path, kind: str, n: int, hold: str = "",
                 strategy: str = "ddp", extra: tuple[str, ...] = ()) -> None:
        self.kind, self.n, self.tag = kind, n, uuid.uuid4().hex
        self.out = tmp / "run"
        self.dumps = self.out / "hang" if kind == "engine" else tmp / "dumps"
        env = cli_env(MPIDIST_TEST_TAG=self.tag, MPIDIST_HANG_DIR=str(self.dumps),
                      MPIDIST_HANG_TIMEOUT=str(HANG_TIMEOUT))
        env.pop("MPIDIST_TEST_HOLD", None)
        if hold:
            env["MPIDIST_TEST_HOLD"] = hold
        if kind == "engine":
            what = [sys.executable, "-m", "mpidist.cli", "train", "--out", str(self.out),
                    "--hang-timeout", str(HANG_TIMEOUT), "--strategy", strategy, *TINY,
                    *extra]
        else:
            what = [sys.executable, str(TORCH_SCRIPT), "1000000"]
        self.log = tmp / "job.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(["timeout", "-k", "5", "200", MPIEXEC, "-n", str(n),
                                          *what], env=env, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=tmp)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def pids(self) -> dict[int, int]:
        """{world rank: pid} of this job's ranks."""
        found: dict[int, int] = {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                env = dict(kv.split(b"=", 1) for kv in
                           (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
                argv0 = (proc / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            rank = env.get(b"OMPI_COMM_WORLD_RANK")
            if env.get(b"MPIDIST_TEST_TAG") == self.tag.encode() and rank is not None \
                    and b"python" in os.path.basename(argv0):
                found[int(rank)] = int(proc.name)
        return found

    def wait_for(self, test, what: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not test():
            assert self.proc.poll() is None, f"the job ended ({what}):\n{self.text()}"
            assert time.monotonic() < deadline, f"no {what} after {seconds} s:\n{self.text()}"
            time.sleep(0.05)

    def wait_running(self) -> None:
        """Until the third step is done (metrics.jsonl, or rank 0's "step 3")."""
        if self.kind == "engine":
            rows = self.out / "metrics.jsonl"
            self.wait_for(lambda: rows.exists() and len(rows.read_text().splitlines()) >= 3,
                          "third step", 150)
        else:
            self.wait_for(lambda: "step 3\n" in self.text(), "third step", 150)
        self.wait_for(lambda: len(self.pids()) == self.n, f"{self.n} ranks", 10)

    def dumps_now(self) -> dict[int, dict]:
        out = {}
        for path in self.dumps.glob("rank-*.json"):
            try:
                d = json.loads(path.read_text())
            except ValueError:
                continue  # (being replaced)
            out[int(d["world_rank"])] = d
        return out

    def wait_dumps(self, ranks: list[int], since: float, seconds: float,
                   reason: str = "hang", step: int = 0) -> dict[int, dict]:
        """The dumps of ``ranks`` written after wall-clock ``since`` for ``reason`` at
        ``step`` or later."""
        def fresh() -> dict[int, dict]:
            return {r: d for r, d in self.dumps_now().items() if d["time"] >= since
                    and d["reason"].startswith(reason) and d["step"] >= step}

        self.wait_for(lambda: set(ranks) <= set(fresh()), f"dumps of ranks {ranks}", seconds)
        return fresh()

    def doctor(self) -> tuple[int, dict]:
        done = subprocess.run([sys.executable, "-m", "mpidist.cli", "doctor",
                               str(self.dumps.parent if self.kind == "engine" else self.dumps),
                               "--json"], capture_output=True, text=True, timeout=60,
                              env=cli_env())
        assert done.returncode in (0, 1), done.stdout + done.stderr
        return done.returncode, json.loads(done.stdout)

    def close(self) -> None:
        for pid in self.pids().values():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def job(tmp_path: Path):
    jobs: list[Job] = []

    def start(*args, **kwargs) -> Job:
        jobs.append(Job(tmp_path, *args, **kwargs))
        return jobs[-1]

    yield start
    for j in jobs:
        j.close()


pytestmark = pytest.mark.skipif(MPIEXEC is None or not Path("/proc/self/environ").exists(),
                                reason="needs mpiexec and /proc")


@pytest.mark.parametrize("kind, how, n", [_case(k, h, n) for k in ("engine", "torch")
                                          for h in ("hold", "stop") for n in (3, 4)])
def test_the_doctor_names_the_rank_the_others_wait_for(job, kind: str, how: str, n: int):
    culprit = n - 2  # not rank 0, not the last
    others = [r for r in range(n) if r != culprit]
    step = HOLD_STEP[kind]
    strategy, phase = ENGINE_HOLD[n] if kind == "engine" else ("ddp", "backward")
    hold = f"rank={culprit},step={step},phase={phase}" if how == "hold" else ""
    j = job(kind, n, hold=hold, strategy=strategy)
    if how == "hold":
        j.wait_for(lambda: "MPIDIST_TEST_HOLD: holding" in j.text(), "hold", 150)
        since = time.time()
        dumps = j.wait_dumps(list(range(n)), since - 2, HANG_TIMEOUT + SLACK, step=step)
    else:
        j.wait_running()
        os.kill(j.pids()[culprit], signal.SIGSTOP)
        since = time.time()
        dumps = j.wait_dumps(others, since, HANG_TIMEOUT + SLACK)
        time.sleep(1.0)
        late = j.dumps_now().get(culprit)
        assert late is None or late["time"] < since, "a stopped rank cannot dump"
    assert all(d["ranks"][str(culprit)].endswith(f":{j.pids()[culprit]}")
               for d in dumps.values())  # every dump names the culprit's host:pid

    status, found = j.doctor()
    assert status == 1 and found["status"] == "stuck", found
    f = found["finding"]
    assert f["kind"] == "collective", found
    assert [c["rank"] for c in found["culprits"]] == [culprit], found
    # the others entered it, or wait in an earlier call the culprit holds up too (a
    # nonblocking collective it had progressed for some of them before it stopped)
    held_up = [c["rank"] for c in found["also_behind"]]
    assert sorted(f["entered"] + held_up) == others and culprit in f["members"], found
    assert all(c["waiting_in"] is not None for c in found["also_behind"]), found
    (c,) = found["culprits"]
    if how == "hold":  # that collective: the first of the held phase, which it never entered
        assert (f["step"], f["phase"]) == (step, phase), found
        assert c["dumped"] and any(fr[2] == "hold" for fr in c["stack"]), c
        assert (j.dumps / f"rank-{culprit}.stacks.txt").exists()
    else:  # the one the others wait in; the stopped rank is named without a stack
        assert not c["dumped"] and c["host"].endswith(f":{j.pids()[culprit]}"), c
        waits = {d["inside"][0]["call"]["seq"] for d in dumps.values() if d["inside"]}
        assert f["seq"] in waits or not waits, (f, waits)


@pytest.mark.parametrize("kind, how, n", [_case(k, "healthy", n) for k in ("engine", "torch")
                                          for n in (3, 4)])
def test_a_healthy_runs_dumps_say_nothing_is_wrong(job, kind: str, how: str, n: int):
    j = job(kind, n)
    j.wait_running()
    since = time.time()
    for pid in j.pids().values():
        os.kill(pid, signal.SIGUSR2)
    j.wait_dumps(list(range(n)), since, SLACK, reason="SIGUSR2")
    status, found = j.doctor()
    assert status == 0 and found["status"] == "ok" and found["finding"] is None, found
    assert found["ranks_dumped"] == list(range(n)) and found["steps_done"] >= 2, found


@pytest.mark.parametrize("kind, how, n", [_case("engine", "abort", 3)])
def test_hang_abort_ends_the_job_after_every_rank_dumped(job, kind: str, how: str, n: int):
    j = job(kind, n, hold="rank=1,step=3,phase=optimizer", extra=("--hang-abort",))
    j.wait_for(lambda: "MPIDIST_TEST_HOLD: holding" in j.text(), "hold", 150)
    since = time.time()
    deadline = time.monotonic() + HANG_TIMEOUT + ABORT_GRACE + SLACK
    while j.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert j.proc.poll() not in (None, 0), j.text()
    assert "hang_abort: ending the job in 5 s (MPI_Abort)" in j.text()
    dumps = j.wait_dumps(list(range(n)), since - 2, 0, step=3)
    assert sorted(dumps) == [0, 1, 2]
