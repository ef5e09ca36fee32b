"""Run torch's distributed conformance suite against a backend under mpiexec, and report.

Plain Python, run outside MPI (it starts the mpiexec jobs itself)::

    python tests/torch/conformance/conformance_driver.py --backend gloo -n 2
    python tests/torch/conformance/conformance_driver.py --backend mpidist -n 2
    python tests/torch/conformance/conformance_driver.py --backend mpidist -n 3 -k all_reduce

The driver lists the suite's tests (importing it as gloo, and as mpi for --extended), keeps
those of the selected categories (``conformance_suite.CATEGORIES``; --all for every test),
records the ones a decorator skips at import time, and starts
``mpiexec -n N python conformance_worker.py run`` over the rest. Each rank runs them in order
and writes one JSON line per test. When the job ends early (a rank hung past --timeout, gave
up waiting for a failed peer after --grace, crashed or called MPI_Abort; or nothing was
written for longer than both and a minute more, when the driver kills the job), the test in
progress is marked hung or errored on the ranks that did not report it, and the driver
relaunches from the next test. A test passes only if it passes on every rank; a failure is
reported with the rank that went wrong first, its first error line, the suite's line and
the line that raised.

What is patched in the suite, and why that is fair: ``conformance_suite.PATCHES``.
Outputs under --out: ``launch-K.log`` (the job's output), ``launch-K/rank-R.jsonl``,
``report.json``; the summary is printed. Exit status 0 when nothing failed, errored or hung.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import conformance_suite as suite

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "conformance_worker.py")
BAD = ("failed", "errored", "hung")
#: Modules that register a backend which torch does not know by itself.
BACKEND_MODULES = {"mpidist": "mpidist.torch"}


@dataclass
class Options:
    """What to run and how."""

    backend: str = "mpidist"
    backend_module: str = ""
    world_size: int = 2
    categories: tuple[str, ...] = suite.DEFAULT_CATEGORIES
    pattern: str = ""
    exclude: str = ""
    tests: tuple[str, ...] = ()
    timeout: float = 120.0
    grace: float = 10.0
    out: str = ""
    isolate: bool = False
    recheck: bool = False
    extended: bool | None = None
    profiling: bool = False
    mpiexec: str = ""
    python: str = sys.executable
    verbose: bool = False

    def module(self) -> str:
        """The module imported in each rank before the suite (registers the backend)."""
        return self.backend_module or BACKEND_MODULES.get(self.backend, "")

    def with_extended(self) -> bool:
        """Whether the extended tests run too (default: for a target other than gloo)."""
        return self.backend != suite.REFERENCE if self.extended is None else self.extended


@dataclass
class Report:
    """Merged outcomes of a whole run."""

    options: dict[str, Any]
    tests: dict[str, dict[str, Any]] = field(default_factory=dict)
    launches: int = 0
    wall_seconds: float = 0.0
    fatal: str = ""
    gloo_branches: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """How many tests ended each way, and how many ran (were not skipped)."""
        c: dict[str, int] = defaultdict(int)
        for t in self.tests.values():
            c[t["outcome"]] += 1
        c["selected"] = len(self.tests)
        c["run"] = len(self.tests) - c["skipped"]
        return dict(c)

    def bad(self) -> dict[str, dict[str, Any]]:
        """The tests that failed, errored or hung."""
        return {n: t for n, t in self.tests.items() if t["outcome"] in BAD}

    def to_json(self) -> dict[str, Any]:
        """The report as written to report.json."""
        return {"options": self.options, "counts": self.counts(), "launches": self.launches,
                "wall_seconds": self.wall_seconds, "fatal": self.fatal,
                "gloo_branches": self.gloo_branches, "tests": self.tests}


def child_env(opts: Options) -> dict[str, str]:
    """The environment of the listing process and of the MPI job."""
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the reference is gloo on the CPU (PATCHES["cpu-only"])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"  # its advice names torch's runner, not ours
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH", "")) if p)
    return env


def list_suite(opts: Options, as_backend: str) -> dict[str, Any]:
    """The suite's tests with their import-time skip reasons, as ``as_backend`` sees them
    (``tests``), and the run-time comparisons with "gloo" (``gloo_branches``)."""
    cmd = [opts.python, WORKER, "list", "--world-size", str(opts.world_size),
           "--as-backend", as_backend]
    done = subprocess.run(cmd, env=child_env(opts), capture_output=True, text=True,
                          timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"listing the suite failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def select(opts: Options, listing: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tests chosen by --tests, or by the categories, -k and --exclude."""
    if opts.tests:
        known = {t["test"] for t in listing}
        missing = [n for n in opts.tests if n not in known]
        if missing:
            raise SystemExit(f"no such tests in the suite: {', '.join(missing)}")
        return [t for t in listing if t["test"] in set(opts.tests)]
    chosen = [t for t in listing if "all" in opts.categories or t["category"] in opts.categories]
    if opts.pattern:
        chosen = [t for t in chosen if re.search(opts.pattern, t["test"])]
    if opts.exclude:
        chosen = [t for t in chosen if not re.search(opts.exclude, t["test"])]
    return chosen


def mpi_gated(opts: Options, listing: list[dict[str, Any]]) -> set[str]:
    """Tests skipped for gloo at import time that the suite runs for 'mpi' on the CPU."""
    as_mpi = {t["test"]: t["static_skip"] for t in list_suite(opts, "mpi")["tests"]}
    return {t["test"] for t in listing
            if t["static_skip"] and "MPI" in t["static_skip"]
            and t["test"] in as_mpi and as_mpi[t["test"]] is None}


def read_records(folder: str) -> dict[int, list[dict[str, Any]]]:
    """The JSON lines each rank wrote (a torn last line is ignored)."""
    out: dict[int, list[dict[str, Any]]] = {}
    if not os.path.isdir(folder):
        return out
    for name in sorted(os.listdir(folder)):
        m = re.fullmatch(r"rank-(\d+)\.jsonl", name)
        if not m:
            continue
        rows = []
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        out[int(m.group(1))] = rows
    return out


def _progress(folder: str) -> int:
    if not os.path.isdir(folder):
        return 0
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """End the job: SIGTERM to mpiexec's process group (mpiexec ends its ranks), then KILL."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def launch(opts: Options, items: list[dict[str, Any]], index: int) -> tuple[int, bool, str]:
    """One mpiexec job over ``items``; returns (exit status, killed by the driver, folder)."""
    folder = os.path.join(opts.out, f"launch-{index}")
    os.makedirs(folder, exist_ok=True)
    tests_file = os.path.join(folder, "tests.json")
    with open(tests_file, "w", encoding="utf-8") as f:
        json.dump(items, f)
    mpiexec = shlex.split(opts.mpiexec or os.environ.get("MPIEXEC", "mpiexec"))
    cmd = [*mpiexec, "-n", str(opts.world_size), opts.python, WORKER, "run",
           "--backend", opts.backend, "--backend-module", opts.module(),
           "--tests", tests_file, "--results", folder,
           "--scratch", os.path.join(folder, "scratch"),
           "--timeout", str(opts.timeout), "--grace", str(opts.grace),
           *(["--profiling"] if opts.profiling else [])]
    stall = opts.timeout + opts.grace + 60.0  # the ranks' own deadlines come first
    with open(os.path.join(opts.out, f"launch-{index}.log"), "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(opts),
                                start_new_session=True)
        size, last = -1, time.monotonic()
        while proc.poll() is None:
            time.sleep(0.5)
            now_size = _progress(folder)
            if now_size != size:
                size, last = now_size, time.monotonic()
            elif time.monotonic() - last > stall:
                _kill(proc)
                shutil.rmtree(os.path.join(folder, "scratch"), ignore_errors=True)
                return proc.wait(), True, folder
    shutil.rmtree(os.path.join(folder, "scratch"), ignore_errors=True)
    return proc.returncode, False, folder


CRASH = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+) "
                   r"\(([^)]*)\)")


MPI_ABORT = re.compile(r"MPI_ABORT was invoked on rank (\d+)|^\[rank (\d+)\].*\bMPI_Abort\b",
                       re.M | re.I)
ABORT_LINE = re.compile(r"^.*\bMPI_Abort\b.*$", re.M)
FAULTHANDLER_TIMEOUT = re.compile(r"^Timeout \(\d+:\d\d:\d\d\)!", re.M)


def _missing(rank: int, rc: int, killed: bool, others: list[dict[str, Any]],
             log: str) -> dict[str, Any]:
    """The result of a rank that did not report a test before its job ended: ``hung`` when
    it was still running when time ran out, ``errored`` when it crashed or was ended because
    another rank crashed. ``consequence`` marks a rank that only suffered another's fault."""
    started = [r["time"] for r in others if r.get("kind") == "start" and r["rank"] == rank]
    row: dict[str, Any] = {"rank": rank, "outcome": "hung", "where": "", "phase": "test",
                           "consequence": True, "failed_at": started[0] if started else 0.0}
    aborts = [r["reason"] for r in others if r.get("kind") == "abort"]
    hung = [r for r in others if r.get("kind") == "result" and r.get("outcome") == "hung"]
    crashed = {int(m.group(1)): f"{m.group(3)} (signal {m.group(2)})"
               for m in CRASH.finditer(log)}
    aborted = [int(m.group(1) or m.group(2)) for m in MPI_ABORT.finditer(log)]
    said = [m.group(0).strip()[:300] for m in ABORT_LINE.finditer(log)]
    if aborted:
        why = f"rank {aborted[0]} called MPI_Abort" + (f": {said[-1]}" if said else "")
        row.update(outcome="errored", consequence=rank != aborted[0],
                   reason=why if rank == aborted[0] else f"the job ended: {why}")
    elif FAULTHANDLER_TIMEOUT.search(log):
        row.update(consequence=False, reason="blocked past the deadline without running "
                   "Python code (the GIL held?); faulthandler dumped the stacks into the "
                   "launch log and ended the process")
    elif rank in crashed:
        row.update(outcome="errored", consequence=False,
                   reason=f"the process died: {crashed[rank]}")
    elif crashed:
        first = min(crashed)
        row.update(outcome="errored", reason=f"ended when rank {first} died: {crashed[first]}")
    elif killed:
        row.update(consequence=False,
                   reason="no rank reported anything for too long; the driver ended the job")
    elif aborts:
        row["reason"] = f"still running when the job ended: {aborts[0]}"
    elif hung:
        row["reason"] = f"still running when rank {hung[0]['rank']} hung and ended the job"
    else:
        row.update(outcome="errored", consequence=False,
                   reason=f"the job ended (mpiexec exit status {rc}) during the test")
    return row


def collect(opts: Options, items: list[dict[str, Any]], rc: int, killed: bool,
            folder: str) -> tuple[dict[str, dict[int, dict[str, Any]]], int, str]:
    """Per-test, per-rank results of one job; the index of the first test still to run
    (``len(items)`` when all ran); and a fatal error, if the job could not start."""
    records = read_records(folder)
    flat = [r for rows in records.values() for r in rows]
    fatal = [r for r in flat if r.get("kind") == "fatal"]
    ready = {r["rank"] for r in flat if r.get("kind") == "ready"}
    log = _tail(folder + ".log")
    if fatal:
        return {}, 0, f"{fatal[0]['reason']}\n{fatal[0].get('detail', '')}"
    if len(ready) < opts.world_size:
        return {}, 0, f"the job did not start (mpiexec exit status {rc}):\n{log[-3000:]}"
    results: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in flat:
        if r.get("kind") == "result":
            results[r["test"]][r["rank"]] = r
    for i, item in enumerate(items):
        name = item["test"]
        if len(results[name]) == opts.world_size:
            continue
        others = [r for r in flat if r.get("test") == name]
        since = log.find(f"] {name}\n")  # the log from this test's first marker on
        since = log.rfind("\n", 0, since) + 1 if since > 0 else 0
        if not others:  # not reached: the job ended between two tests
            if i == 0:
                return {}, 0, f"the job ended before its first test:\n{log[-3000:]}"
            return {k: v for k, v in results.items() if v}, i, ""
        for rank in range(opts.world_size):
            if rank not in results[name]:
                results[name][rank] = {"test": name,
                                       **_missing(rank, rc, killed, others, log[since:])}
        return {k: v for k, v in results.items() if v}, i + 1, ""
    return {k: v for k, v in results.items() if v}, len(items), ""


def _tail(path: str, size: int = 1 << 20) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - size))
        return f.read().decode("utf-8", "replace")


def _root_cause(per_rank: dict[int, dict[str, Any]]) -> int | None:
    """The rank whose failure came first (not one that only suffered another's), or None."""
    bad = [r for r, row in per_rank.items() if row["outcome"] in BAD]
    if not bad:
        return None
    return min(bad, key=lambda r: (bool(per_rank[r].get("consequence")),
                                   per_rank[r].get("failed_at") or float("inf"), r))


def merge(name: str, per_rank: dict[int, dict[str, Any]], category: str) -> dict[str, Any]:
    """One outcome for the test. It passes only if it passes on every rank; otherwise it
    takes the outcome and first error line of the rank that went wrong first. A test that
    rank 0 skips is skipped (torch's parent process reads rank 0's exit code)."""
    ranks = sorted(per_rank)
    cause = _root_cause(per_rank)
    first = per_rank[ranks[0] if cause is None else cause]
    by: dict[str, list[int]] = defaultdict(list)
    for r in ranks:
        by[per_rank[r]["outcome"]].append(r)
    others = {str(r): per_rank[r].get("reason", "") for r in ranks
              if per_rank[r]["outcome"] in BAD and r != cause}
    return {"test": name, "category": category, "outcome": first["outcome"],
            "rank": first["rank"], "reason": first.get("reason", ""),
            "where": first.get("where", ""), "raised_at": first.get("raised_at", ""),
            "phase": first.get("phase", ""),
            "ranks": dict(by), "other_reasons": others,
            "seconds": max(float(per_rank[r].get("seconds", 0.0)) for r in ranks),
            "notes": sorted({n for r in ranks for n in per_rank[r].get("notes", [])}),
            "detail": {str(r): per_rank[r].get("detail", "") for r in ranks
                       if per_rank[r].get("detail")}}


def run_items(opts: Options, items: list[dict[str, Any]], report: Report,
              categories: dict[str, str]) -> None:
    """Run ``items`` in as few jobs as possible (one per test with --isolate)."""
    todo = list(items)
    while todo and not report.fatal:
        batch = todo[:1] if opts.isolate else todo
        report.launches += 1
        if opts.verbose:
            print(f"launch {report.launches}: {len(batch)} tests from {batch[0]['test']}",
                  file=sys.stderr)
        rc, killed, folder = launch(opts, batch, report.launches)
        results, stop, fatal = collect(opts, batch, rc, killed, folder)
        if fatal:
            report.fatal = fatal
            return
        for name, per_rank in results.items():
            report.tests[name] = merge(name, per_rank, categories[name])
        todo = todo[stop:]


def recheck(opts: Options, report: Report, categories: dict[str, str],
            items: dict[str, dict[str, Any]]) -> None:
    """Run each failed, errored or hung test again alone and note what it does there."""
    for name in list(report.bad()):
        alone = Report(options={})
        alone.launches = report.launches
        iso = Options(**{**opts.__dict__, "isolate": True})
        run_items(iso, [items[name]], alone, categories)
        report.launches = alone.launches
        got = alone.tests.get(name, {}).get("outcome", "not run: " + alone.fatal[:200])
        report.tests[name]["notes"].append(f"run alone: {got}")


def run(opts: Options) -> Report:
    """List, select, run, merge; the whole conformance run."""
    start = time.monotonic()
    opts.out = opts.out or tempfile.mkdtemp(prefix="conformance-")
    os.makedirs(opts.out, exist_ok=True)
    report = Report(options={k: v for k, v in opts.__dict__.items() if k != "python"})
    listing = list_suite(opts, suite.REFERENCE)
    report.gloo_branches = listing["gloo_branches"] if opts.backend != suite.REFERENCE else []
    chosen = select(opts, listing["tests"])
    extended = opts.with_extended()
    gated = mpi_gated(opts, chosen) if extended else set()
    small_world = extended and opts.world_size >= 3
    categories = {t["test"]: t["category"] for t in chosen}
    items = []
    for t in chosen:
        if t["static_skip"] and t["test"] not in gated:
            report.tests[t["test"]] = {
                "test": t["test"], "category": t["category"], "outcome": "skipped", "rank": 0,
                "reason": t["static_skip"], "where": "", "phase": "import", "other_reasons": {},
                "ranks": {"skipped": list(range(opts.world_size))}, "seconds": 0.0,
                "notes": [], "detail": {}}
        else:
            items.append({"test": t["test"], "unskip": t["test"] in gated,
                          "small_world": small_world})
    run_items(opts, items, report, categories)
    if opts.recheck and not report.fatal:
        recheck(opts, report, categories, {i["test"]: i for i in items})
    report.tests = {t["test"]: report.tests[t["test"]] for t in chosen if t["test"] in report.tests}
    report.wall_seconds = round(time.monotonic() - start, 1)
    with open(os.path.join(opts.out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report.to_json(), f, indent=1)
    return report


def _names(names: list[str], width: int = 100) -> str:
    return textwrap.fill(", ".join(names), width=width, initial_indent="      ",
                         subsequent_indent="      ")


def format_report(report: Report) -> str:
    """The human-readable summary: counts, skip reasons, failures with their first line."""
    o, c = report.options, report.counts()
    lines = [f"torch distributed conformance: backend {o['backend']}, {o['world_size']} ranks, "
             f"{c['selected']} tests selected, {report.wall_seconds} s, "
             f"{report.launches} mpiexec launches (results in {o['out']})",
             f"run {c['run']}: passed {c.get('passed', 0)}, failed {c.get('failed', 0)}, "
             f"errored {c.get('errored', 0)}, hung {c.get('hung', 0)}; "
             f"skipped {c.get('skipped', 0)}"]
    if report.gloo_branches:
        lines.append("gloo's branch taken by the target at: " + ", ".join(report.gloo_branches))
    if report.fatal:
        lines.append(f"FATAL: {report.fatal.strip()}")
    skips: dict[str, list[str]] = defaultdict(list)
    for t in report.tests.values():
        if t["outcome"] == "skipped":
            skips[t["reason"]].append(t["test"])
    if skips:
        lines.append("skipped, by reason:")
    for reason, names in sorted(skips.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines += [f"  {len(names):3d}  {reason}", _names(names)]
    bad = report.bad()
    if bad:
        lines.append("failed, errored or hung:")
    for name, t in bad.items():
        ranks = "; ".join(f"{k} on {','.join(map(str, v))}" for k, v in t["ranks"].items())
        lines.append(f"  {t['outcome']:7s} {name} [{ranks}] rank {t['rank']}, {t['phase']}: "
                     f"{t['reason'][:300]}")
        if t["where"]:
            lines.append(f"          at {t['where']}")
        if t.get("raised_at") and t["raised_at"] != t["where"]:
            lines.append(f"          raised at {t['raised_at']}")
        for rank, reason in t.get("other_reasons", {}).items():
            lines.append(f"          rank {rank}: {reason[:200]}")
        for note in t["notes"]:
            lines.append(f"          note: {note}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> Options:
    """Options from the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Categories: " + ", ".join(suite.CATEGORIES)
                                + "; default: " + ",".join(suite.DEFAULT_CATEGORIES))
    p.add_argument("--backend", default=os.environ.get("MPIDIST_CONFORMANCE_BACKEND", "mpidist"))
    p.add_argument("--backend-module", default="",
                   help="module imported in each rank first (default for mpidist: mpidist.torch)")
    p.add_argument("-n", "--world-size", type=int, default=2)
    p.add_argument("--categories", default=",".join(suite.DEFAULT_CATEGORIES),
                   help="comma-separated categories, or 'all'")
    p.add_argument("--all", action="store_true", help="every test of the suite")
    p.add_argument("-k", "--pattern", default="", help="only tests whose name matches")
    p.add_argument("--exclude", default="", help="not the tests whose name matches")
    p.add_argument("--tests", default="", help="comma-separated test names (overrides the rest)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per test")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds a rank whose test failed waits for the others")
    p.add_argument("--out", default="", help="output folder (default: a new temporary one)")
    p.add_argument("--isolate", action="store_true", help="one mpiexec job per test")
    p.add_argument("--recheck", action="store_true", help="run each failure again alone")
    ext = p.add_mutually_exclusive_group()
    ext.add_argument("--extended", dest="extended", action="store_true", default=None,
                     help="also what the suite runs only for 'mpi' (all_to_all; the group "
                     "tests at 3+ ranks); default: on for a target other than gloo")
    ext.add_argument("--no-extended", dest="extended", action="store_false")
    p.add_argument("--profiling", action="store_true",
                   help="hold the target to gloo's profiler-event assertions too")
    p.add_argument("--mpiexec", default="", help="launcher command (default: $MPIEXEC or mpiexec)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    cats = ("all",) if a.all else tuple(c for c in a.categories.split(",") if c)
    unknown = [c for c in cats if c != "all" and c not in suite.CATEGORIES]
    if unknown:
        p.error(f"unknown categories: {', '.join(unknown)}")
    return Options(backend=a.backend, backend_module=a.backend_module, world_size=a.world_size,
                   categories=cats, pattern=a.pattern, exclude=a.exclude,
                   tests=tuple(t for t in a.tests.split(",") if t), timeout=a.timeout,
                   grace=a.grace, out=a.out, isolate=a.isolate, recheck=a.recheck,
                   extended=a.extended, profiling=a.profiling, mpiexec=a.mpiexec,
                   python=a.python, verbose=a.verbose)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run, print the summary, exit 1 on any failure."""
    report = run(parse(argv))
    print(format_report(report))
    return 1 if report.fatal or report.bad() else 0


if __name__ == "__main__":
    sys.exit(main())
