"""One MPI rank of a conformance run: run a list of tests of torch's suite in order.

Started by :mod:`conformance_driver` as ``mpiexec -n N python conformance_worker.py run ...``.
Each rank writes JSON lines to its own results file, flushed at once: ``ready`` once the
suite is loaded, ``start`` before each test, ``result`` after it (see
:class:`conformance_suite.Outcome`), ``abort`` when it gives up waiting for the others.

Between two tests the ranks meet in a nonblocking barrier on a communicator of the harness
(a duplicate of COMM_WORLD that the backend under test never sees), polled against a
deadline. A watchdog thread ends the rank (``os._exit``) when a test overruns its deadline,
after writing a ``hung`` result with the line the main thread is blocked on; a rank whose
test failed waits only a short grace time for the others, since they may be blocked in a
collective it never entered. Either way the job ends and the driver relaunches it from the
next test.

``python conformance_worker.py list`` (no MPI) prints the suite's tests as JSON.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from typing import IO, Any

import conformance_suite as suite

EXIT_HUNG = 4
EXIT_PEERS = 5
FALLBACK_SECONDS = 15.0


class Recorder:
    """Appends JSON lines to this rank's results file, one flushed write per line."""

    def __init__(self, path: str, rank: int) -> None:
        self.rank = rank
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        """Write one record, tagged with this rank and the time."""
        line = json.dumps({"rank": self.rank, "time": round(time.time(), 3), **record})
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())


def _main_thread_lines() -> tuple[str, str]:
    """Where the main thread is: its innermost line in the suite, and its innermost line."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return suite.locate(traceback.extract_stack(frame)) if frame is not None else ("", "")


class Watchdog:
    """Ends the process when the armed test overruns its deadline (a hung rank)."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self._lock = threading.Lock()
        self._test: str | None = None
        self._deadline = 0.0
        self._started = 0.0
        threading.Thread(target=self._loop, name="conformance-watchdog", daemon=True).start()

    def arm(self, test: str, seconds: float) -> None:
        """Watch ``test`` for ``seconds`` from now."""
        with self._lock:
            self._test, self._started = test, time.monotonic()
            self._deadline = self._started + seconds
        # Fallback for a main thread that blocks while holding the GIL (this thread then
        # never runs): faulthandler's own C thread dumps the stacks and ends the process.
        faulthandler.dump_traceback_later(seconds + FALLBACK_SECONDS, exit=True)

    def disarm(self) -> None:
        """Stop watching (the test returned)."""
        faulthandler.cancel_dump_traceback_later()
        with self._lock:
            self._test = None

    def _loop(self) -> None:
        while True:
            time.sleep(0.5)
            with self._lock:
                test, late = self._test, time.monotonic() > self._deadline
                waited = time.monotonic() - self._started
            if test is None or not late:
                continue
            where, innermost = _main_thread_lines()
            sys.stderr.write(f"[rank {self._recorder.rank}] {test} hung; stacks follow\n")
            faulthandler.dump_traceback(all_threads=True)
            out = suite.Outcome(test=test, rank=self._recorder.rank, outcome="hung",
                                reason=f"no result after {waited:.0f} s", where=where,
                                raised_at=innermost,
                                seconds=round(waited, 3), failed_at=round(time.time(), 3))
            self._recorder.write(out.record())
            os._exit(EXIT_HUNG)


def resync(comm: Any, deadline: float) -> bool:
    """Nonblocking barrier on the harness's communicator, polled until ``deadline``."""
    request = comm.Ibarrier()
    pause = 0.001
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return True


def _test_dirs(comm: Any, base: str) -> tuple[str, str]:
    """A fresh TEMP_DIR (barrier/, test_dir/, init_dir/) and init file, made by rank 0."""
    paths = None
    if comm.Get_rank() == 0:
        temp = tempfile.mkdtemp(prefix="test-", dir=base)
        for sub in ("barrier", "test_dir", "init_dir"):
            os.mkdir(os.path.join(temp, sub))
        paths = (temp, os.path.join(temp, "init_file"))
    return comm.bcast(paths, root=0)


def _run_one(ctx: dict[str, Any], item: dict[str, Any]) -> bool:
    """Run one test on this rank, record it, and meet the others. False: give up."""
    comm, rec, args = ctx["comm"], ctx["recorder"], ctx["args"]
    name = item["test"]
    temp, init_file = _test_dirs(comm, ctx["base"])
    os.environ["TEMP_DIR"] = temp
    ctx["module"].INIT_METHOD = "file://" + os.path.join(temp, "init_dir", "shared_init_file")
    sys.stderr.write(f"===== [rank {rec.rank}] {name}\n")
    sys.stderr.flush()
    rec.write({"kind": "start", "test": name})
    start = time.monotonic()
    ctx["watchdog"].arm(name, args.timeout)
    out = suite.run_test(ctx["module"], ctx["cls"], name, args.backend, rec.rank, init_file,
                         unskip=bool(item.get("unskip")),
                         small_world=bool(item.get("small_world")))
    ctx["watchdog"].disarm()
    rec.write(out.record())
    deadline = start + args.timeout
    if out.outcome not in ("passed", "skipped"):
        deadline = min(deadline, time.monotonic() + args.grace)
    if not resync(comm, deadline):
        rec.write({"kind": "abort", "test": name,
                   "reason": f"rank {rec.rank} ({out.outcome}) waited for the other ranks "
                             f"to finish {name} until the deadline"})
        return False
    if comm.Get_rank() == 0:
        shutil.rmtree(temp, ignore_errors=True)
    return True


def _load(args: argparse.Namespace, comm: Any, rec: Recorder) -> dict[str, Any] | None:
    """Import the backend's module and the suite; write ``ready`` or ``fatal``."""
    base = args.scratch
    if comm.Get_rank() == 0:
        os.makedirs(base, exist_ok=True)
    comm.Barrier()
    try:
        if args.backend_module:
            importlib.import_module(args.backend_module)
        module, cls = suite.load_suite(args.backend, comm.Get_size(),
                                       os.path.join(base, "import_init_file"), args.profiling)
    except BaseException as exc:  # noqa: B036 - report any import failure, then stop
        rec.write({"kind": "fatal", "reason": f"{type(exc).__name__}: {exc}",
                   "detail": traceback.format_exc()[-4000:]})
        return None
    rec.write({"kind": "ready", "size": comm.Get_size(), "pid": os.getpid()})
    return {"comm": comm, "recorder": rec, "args": args, "base": base, "module": module,
            "cls": cls, "watchdog": Watchdog(rec)}


def run(args: argparse.Namespace) -> int:
    """The ``run`` command: every listed test in order, under mpiexec."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    faulthandler.enable()
    os.makedirs(args.results, exist_ok=True)
    rec = Recorder(os.path.join(args.results, f"rank-{rank}.jsonl"), rank)
    with open(args.tests, encoding="utf-8") as f:
        items = json.load(f)
    ctx = _load(args, comm, rec)
    if ctx is None:
        return 3
    for item in items:
        if not _run_one(ctx, item):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_PEERS)
    ok = resync(comm, time.monotonic() + args.grace)
    if rank == 0:
        shutil.rmtree(ctx["base"], ignore_errors=True)
    rec.write({"kind": "done"})
    comm.Free()
    return 0 if ok else EXIT_PEERS


def list_command(args: argparse.Namespace) -> int:
    """The ``list`` command: the suite's tests as ``as_backend`` sees them, as JSON."""
    base = tempfile.mkdtemp(prefix="conformance-list-")
    try:
        module = suite.import_suite(args.world_size, os.path.join(base, "init"), args.as_backend)
        listing = {"tests": suite.list_tests(suite.suite_class(module)),
                   "gloo_branches": suite.gloo_branches(module)}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    json.dump(listing, sys.stdout)
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the worker (used by the driver, not by hand)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run tests (under mpiexec)")
    r.add_argument("--backend", required=True)
    r.add_argument("--backend-module", default="")
    r.add_argument("--tests", required=True, help="JSON file: [{test, unskip, small_world}, ...]")
    r.add_argument("--results", required=True, help="folder for rank-R.jsonl")
    r.add_argument("--timeout", type=float, default=120.0)
    r.add_argument("--grace", type=float, default=10.0)
    r.add_argument("--profiling", action="store_true")
    r.add_argument("--scratch", required=True, help="folder for the tests' files (shared)")
    ls = sub.add_parser("list", help="list the suite's tests as JSON (no MPI)")
    ls.add_argument("--world-size", type=int, default=2)
    ls.add_argument("--as-backend", default=suite.REFERENCE)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse(argv)
    return run(args) if args.command == "run" else list_command(args)


if __name__ == "__main__":
    sys.exit(main())
