"""``mpidist train --trace`` and the straggler reports, run as a user runs them (mpiexec).

- The trace is valid JSON holding every rank's events for exactly the asked steps, properly
  nested on every track, each rank's clock offset found within its stated bound when the
  ranks' clocks are made to differ by seconds (``MPIDIST_TEST_CLOCK_OFFSET``), and no
  collective ending on one rank before another rank entered it (beyond twice that bound).
- The pipeline picture's blocks run in the schedule's orders (1F1B on 3 stages, zero-bubble,
  interleaved).
- A rank slowed deterministically (``MPIDIST_TEST_SLOW``) is named in events.jsonl, on the
  progress line and in the summary; an even run at 2 ranks names none.

These tests start mpiexec themselves (under ``timeout``): they are not mpi-marked.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_env import cli_env
from trace_checks import improperly_nested

from mpidist.parallel.schedules import orders
from mpidist.run.trace import schedule_from_trace

MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH")

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
        "--eval-interval", "0", "--eval-batches", "1", "--checkpoint-interval", "0",
        "--dtype", "float64"]
#: collectives after which no rank can have left before every rank entered
SYNCHRONISING = {"Allreduce", "Allgather", "Allgatherv", "Alltoall", "Alltoallv", "Barrier",
                 "Reduce_scatter", "Reduce_scatter_block", "Iallreduce", "Iallgather",
                 "Iallgatherv", "Ireduce_scatter", "Ireduce_scatter_block", "Ibarrier"}


def train(n: int, out: Path, *args: str, env: dict | None = None, timeout: int = 240
          ) -> subprocess.CompletedProcess:
    cmd = ["timeout", "-k", "10", str(timeout), MPIEXEC, "-n", str(n), sys.executable, "-m",
           "mpidist.cli", "train", "--out", str(out), *TINY, *args]
    proc = subprocess.run(cmd, env=cli_env(**(env or {})), capture_output=True, text=True,
                          timeout=timeout + 30)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_trace_holds_every_rank_aligned_when_clocks_differ(tmp_path: Path):
    out = tmp_path / "run"
    offsets = {1: 5.0, 2: -3.0}
    train(3, out, "--strategy", "zero3", "--global-batch", "6", "--steps", "6",
          "--trace", "3:4", "--no-progress",
          env={"MPIDIST_TEST_CLOCK_OFFSET": ",".join(f"{r}:{s}" for r, s in offsets.items())})
    trace = json.loads((out / "trace.json").read_text())  # valid JSON
    info = trace["otherData"]["mpidist"]
    assert info["steps"] == [3, 4] and info["world_size"] == 3
    bound = info["alignment_bound_s"]
    assert 0 < bound < 0.05
    for r in info["ranks"]:
        assert r["skew_s"] == offsets.get(r["rank"], 0.0)
        # one host: the true offset is minus the injected one; NTP's bound holds exactly
        assert abs(r["offset_s"] + r["skew_s"]) <= r["bound_s"] + 1e-9
    ev = trace["traceEvents"]
    xs = [e for e in ev if e["ph"] == "X"]
    assert not improperly_nested(ev)
    steps = {(e["tid"] // 1000, e["args"]["step"]) for e in xs if e["cat"] == "step"}
    assert steps == {(r, s) for r in range(3) for s in (3, 4)}
    for r in range(3):
        mine = {e["cat"] for e in xs if e["tid"] // 1000 == r}
        assert {"unit", "phase", "mpi", "mpi-async", "data", "optimizer"} <= mine
    named = {(e["pid"], e["tid"]) for e in ev if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in xs} <= named
    assert [e["args"]["name"] for e in ev if e["name"] == "process_name"] == \
        [f"host {info['ranks'][0]['host']}"]
    # aligned: no synchronising collective ends on a rank before every rank entered it
    calls: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for e in xs:
        if e["cat"] in ("mpi", "mpi-async") and e["name"] in SYNCHRONISING \
                and e["args"].get("completed", True):
            calls.setdefault((e["args"]["comm"], e["args"]["seq"]), []).append(
                (e["ts"], e["ts"] + e["dur"]))
    full = [v for v in calls.values() if len(v) == 3]
    assert len(full) >= 10
    worst = max(max(a for a, _ in v) - min(b for _, b in v) for v in full)
    assert worst <= 2 * bound * 1e6 + 1.0, f"a collective ended {worst:.1f} us before all entered"


@pytest.mark.parametrize(("ranks", "schedule", "flags"), [
    (3, "1f1b", ["--pp", "3", "--micro-batches", "4", "--global-batch", "8"]),
    (2, "zero-bubble", ["--pp", "2", "--micro-batches", "4", "--global-batch", "8"]),
    (2, "interleaved", ["--pp", "2", "--virtual-stages", "2", "--micro-batches", "4",
                        "--global-batch", "8"]),
])
def test_schedule_picture_blocks_follow_the_schedule(tmp_path: Path, ranks: int,
                                                      schedule: str, flags: list[str]):
    out = tmp_path / schedule
    train(ranks, out, "--strategy", "hybrid", "--schedule", schedule, *flags, "--steps", "4",
          "--trace", "2:3", "--no-progress")
    ev = json.loads((out / "trace.json").read_text())["traceEvents"]
    p = int(flags[1])
    v = int(flags[flags.index("--virtual-stages") + 1]) if "--virtual-stages" in flags else 1
    want = orders(schedule, p, 4, v)
    for step in (2, 3):
        # read from the trace itself: each rank's pipeline blocks inside that step
        for rank in range(ranks):
            span = next(e for e in ev if e.get("cat") == "step" and e["tid"] == rank * 1000
                        and e["args"]["step"] == step)
            mine = sorted((e for e in ev if e.get("cat") == "pipeline"
                           and e["tid"] == rank * 1000
                           and span["ts"] <= e["ts"] <= span["ts"] + span["dur"]),
                          key=lambda e: e["ts"])
            got = [(e["args"]["kind"], e["args"]["micro_batch"], e["args"]["chunk"])
                   for e in mine]
            assert got == want[mine[0]["args"]["stage"]], (step, rank)
        # what the picture draws
        rows = schedule_from_trace(ev, step)
        assert sorted(rows) == list(range(p))
        assert [[(b["kind"], b["micro_batch"], b["chunk"]) for b in rows[s]]
                for s in range(p)] == want
    assert (out / "schedule.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _events(out: Path, kind: str) -> list[dict]:
    rows = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == kind]


def test_a_slowed_rank_is_named(tmp_path: Path):
    out = tmp_path / "slow"
    proc = train(3, out, "--strategy", "ddp", "--global-batch", "6", "--steps", "9",
                 "--straggler-interval", "2",
                 env={"MPIDIST_TEST_SLOW": "1:0.05"})
    (named,) = _events(out, "straggler")
    # reports at steps 2 (step 1 warms up: in none), 4, ...: two in a row at step 4
    assert [d["rank"] for d in named["ranks"]] == [1] and named["step"] == 4
    d = named["ranks"][0]
    assert d["compute_s"] - d["fastest_s"] > 0.04 and d["ratio"] > 1.3
    summary = json.loads((out / "summary.json").read_text())
    assert [s["step"] for s in summary["stragglers"]] == [4]
    slow = summary["rank_times"][1]["compute_s"]
    assert all(r["compute_s"] < slow - 0.03 for r in summary["rank_times"] if r["rank"] != 1)
    text = proc.stdout + proc.stderr
    assert "straggler rank 1" in text  # the progress line
    assert "straggler: rank 1 on" in text  # the warning
    assert "stragglers            step 4: rank 1" in proc.stdout  # the summary
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    reports = {r["step"]: r["stragglers"] for r in metrics if "stragglers" in r}
    assert reports == {2: [], 4: [1], 6: [1], 8: [1]}


def test_an_even_run_names_no_straggler(tmp_path: Path):
    out = tmp_path / "even"
    # steps of about 30 ms of computation: a few ms of the machine's other work on one
    # core are a few percent, not the margin's 30% (with 6 ms steps they were up to 39%)
    train(2, out, "--strategy", "ddp", "--global-batch", "8", "--steps", "25",
          "--straggler-interval", "4", "--n-embd", "128", "--block-size", "64",
          "--no-progress")
    assert _events(out, "straggler") == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stragglers"] == []
    assert [r["steps"] for r in summary["rank_times"]] == [25, 25]
