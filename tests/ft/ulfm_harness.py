"""Start a small MPI program for a fault-tolerance test and watch it.

``run_job(program, n)`` starts ``program`` (a file in tests/ft/programs, which imports
``ftprog`` first) on ``n`` ranks, under the ULFM stack (``jobs/ulfm-mpiexec``: Open MPI 5
with ``--with-ft ulfm``) or the system's ``mpiexec``, always under ``timeout``. Each rank's
stdout and stderr land in files of their own (ftprog redirects them; processes spawned
into the job too, as ranks 100, 101...), its JSON events are read while the job runs,
and a rank can be SIGKILLed from outside by its pid when it emits a named event
(``kill_on``), or kill itself at a named point (``kill_at``). When the job
outlives its limit, the whole process group and every reported pid are SIGKILLed: a
failing test never leaves ranks behind.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PROGRAMS = HERE / "programs"
LAUNCHER = REPO / "jobs" / "ulfm-mpiexec"
# variables of a surrounding run that would change what a program does
INHERITED = ("MPIDIST_RESTART", "MPIDIST_SLOTS", "MPIDIST_RUN_LOCK_TOKEN", "SLURM_JOB_ID",
             "SLURM_RESTART_COUNT", "MPIDIST_FT_TEST_KILL", "MPIDIST_FT_TEST_DIR")
_JOBS = itertools.count()


def ulfm_prefix() -> Path:
    """Where the Open MPI 5 with fault tolerance is (``make ulfm``: .ulfm/)."""
    return Path(os.environ.get("MPIDIST_ULFM_PREFIX") or REPO / ".ulfm")


def ulfm_missing() -> str | None:
    """Why the ULFM stack cannot run here, or None."""
    prefix = ulfm_prefix()
    if not (prefix / "bin" / "mpiexec").exists() or not (prefix / "lib" / "libmpi.so.40").exists():
        return (f"no Open MPI 5 with fault tolerance at {prefix} (run `make ulfm`, or set "
                "MPIDIST_ULFM_PREFIX)")
    return None


@dataclass
class Job:
    """What one run left: mpiexec's exit status and output, each rank's output and events,
    the ranks killed from outside (rank -> wall time of the SIGKILL)."""

    returncode: int
    timed_out: bool
    elapsed: float
    out: dict[int, str]
    err: dict[int, str]
    launcher_out: str
    launcher_err: str
    events: dict[int, list[dict]]
    killed: dict[int, float] = field(default_factory=dict)

    def last(self, rank: int, name: str) -> dict | None:
        """``rank``'s last event called ``name``, or None."""
        found = [e for e in self.events.get(rank, []) if e["event"] == name]
        return found[-1] if found else None

    def each(self, name: str) -> dict[int, dict]:
        """rank -> its last event called ``name``, for the ranks that emitted one."""
        out = {r: self.last(r, name) for r in self.events}
        return {r: e for r, e in out.items() if e is not None}

    def report(self) -> str:
        """Everything, for an assertion message."""
        parts = [f"exit status {self.returncode} (timed out: {self.timed_out}) after "
                 f"{self.elapsed:.1f} s; killed from outside: {self.killed}",
                 f"--- mpiexec stdout\n{self.launcher_out}", f"--- mpiexec stderr\n"
                 f"{self.launcher_err}"]
        for r in sorted(set(self.out) | set(self.err)):
            parts.append(f"--- rank {r} stdout\n{self.out.get(r, '')}")
            parts.append(f"--- rank {r} stderr\n{self.err.get(r, '')}")
        return "\n".join(parts)


def _env(out_dir: Path, stack: str, kill_at: tuple[int, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in INHERITED}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               MPIDIST_FT_TEST_DIR=str(out_dir))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if stack == "system":  # the system's libmpi only
        lib = str(ulfm_prefix() / "lib")
        kept = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p != lib]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(kept)
    if kill_at is not None:
        env["MPIDIST_FT_TEST_KILL"] = f"{kill_at[0]}:{kill_at[1]}"
    return env


def _command(stack: str, n: int, limit: int, mpiexec_args: tuple[str, ...],
             argv: list[str]) -> list[str]:
    if stack == "ulfm":
        return [str(LAUNCHER), "--timeout", str(limit), "-n", str(n), *mpiexec_args, *argv]
    if stack == "system":
        mpiexec = shutil.which("mpiexec")
        if mpiexec is None:
            raise FileNotFoundError("no mpiexec on PATH")
        return ["timeout", "-k", "10", str(limit), mpiexec, "-n", str(n), *mpiexec_args, *argv]
    raise ValueError(f"stack must be 'ulfm' or 'system', not {stack!r}")


class _Watcher:
    """Reads the ranks' event lines as they are written (by offset, whole lines only)."""

    def __init__(self, out_dir: Path, n: int) -> None:
        self.out_dir = out_dir
        self.paths = {r: out_dir / f"rank-{r}.out" for r in range(n)}
        self.offsets = dict.fromkeys(self.paths, 0)
        self.events: dict[int, list[dict]] = {r: [] for r in self.paths}

    def _discover(self) -> None:
        """Files of processes spawned into the job (rank-100.out...: ftprog)."""
        for path in self.out_dir.glob("rank-*.out"):
            r = path.name[5:-4]
            if r.isdigit() and int(r) not in self.paths:
                self.paths[int(r)] = path
                self.offsets[int(r)] = 0
                self.events.setdefault(int(r), [])

    def poll(self) -> list[dict]:
        new = []
        self._discover()
        for r, path in self.paths.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[r])
                    chunk = f.read()
            except FileNotFoundError:
                continue
            end = chunk.rfind(b"\n") + 1
            self.offsets[r] += end
            for line in chunk[:end].decode(errors="replace").splitlines():
                if line.startswith('{"event"'):
                    try:
                        new.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
        for e in new:
            self.events.setdefault(e["rank"], []).append(e)
        return new

    def pids(self) -> list[int]:
        return [e["pid"] for es in self.events.values() for e in es if e["event"] == "started"]


def _kill_everything(proc: subprocess.Popen, pids: list[int]) -> None:
    for kill in ([lambda: os.killpg(proc.pid, signal.SIGKILL)]
                 + [lambda p=p: os.kill(p, signal.SIGKILL) for p in pids]):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def run_job(program: str, n: int = 4, args: tuple[str, ...] = (), *, tmp: Path,
            stack: str = "ulfm", mpiexec_args: tuple[str, ...] = (),
            kill_on: tuple[int, str] | None = None, kill_at: tuple[int, str] | None = None,
            timeout: float = 60.0) -> Job:
    """Run ``tests/ft/programs/<program>`` on ``n`` ranks and return its :class:`Job`.

    ``stack``: "ulfm" (jobs/ulfm-mpiexec) or "system" (``mpiexec`` on PATH, its own
    libmpi). ``kill_on=(rank, event)``: SIGKILL that rank (by the pid it reported) as soon
    as it emits that event. ``kill_at=(rank, point)``: that rank kills itself at
    ``ftprog.point(point)``. ``timeout``: seconds for the whole job; past it, everything is
    killed and ``timed_out`` is set.
    """
    out_dir = tmp / f"job-{next(_JOBS)}"
    out_dir.mkdir(parents=True)
    argv = [sys.executable, str(PROGRAMS / program), *args]
    cmd = _command(stack, n, int(timeout), mpiexec_args, argv)
    watcher = _Watcher(out_dir, n)
    killed: dict[int, float] = {}
    start = time.monotonic()
    with open(out_dir / "mpiexec.out", "wb") as lo, open(out_dir / "mpiexec.err", "wb") as le:
        proc = subprocess.Popen(cmd, stdout=lo, stderr=le, env=_env(out_dir, stack, kill_at),
                                cwd=out_dir, start_new_session=True)
        timed_out = False
        while proc.poll() is None:
            for e in watcher.poll():
                if kill_on and (e["rank"], e["event"]) == kill_on and e["rank"] not in killed:
                    pid = next(p["pid"] for p in watcher.events[e["rank"]]
                               if p["event"] == "started")
                    os.kill(pid, signal.SIGKILL)
                    killed[e["rank"]] = time.time()
            if time.monotonic() - start > timeout + 20:  # the launcher's own limit failed
                timed_out = True
                break
            time.sleep(0.005)
        if timed_out or proc.returncode in (124, 137):
            timed_out = True
            _kill_everything(proc, watcher.pids())
        proc.wait()
    watcher.poll()

    def read(name: str) -> str:
        path = out_dir / name
        return path.read_text(errors="replace") if path.exists() else ""

    return Job(returncode=proc.returncode, timed_out=timed_out,
               elapsed=time.monotonic() - start,
               out={r: read(f"rank-{r}.out") for r in sorted(watcher.paths)},
               err={r: read(f"rank-{r}.err") for r in sorted(watcher.paths)},
               launcher_out=read("mpiexec.out"), launcher_err=read("mpiexec.err"),
               events=watcher.events, killed=killed)
