"""Straggler scoring, the per-rank record, the trace window's settings and the schedule's
picture, without MPI; and, in one process, that a run without --trace installs no recorder
while a run with one records exactly the asked steps."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from mpidist.core import calls, comms
from mpidist.core import timeline as T
from mpidist.parallel.schedules import orders
from mpidist.run.config import TrainConfig
from mpidist.run.stragglers import (
    RankTimes,
    StragglerWatch,
    find_stragglers,
    measure_peak_flops,
    rank_table_lines,
    unpack_table,
)
from mpidist.run.timeline import slow_spec
from mpidist.run.trace import parse_trace_steps, plot_schedule, schedule_from_trace


def _row(rank: int, compute: float, *, host: str = "a", stage: int = 0, samples: float = 2,
         steps: int = 4, step_s: float = 0.0) -> dict:
    return {"rank": rank, "host": host, "stage": stage, "samples": samples, "steps": steps,
            "compute_s": compute, "step_seconds": steps * max(step_s, compute)}


def test_find_stragglers_against_the_fastest_of_the_same_work():
    rows = [_row(0, 0.10), _row(1, 0.12), _row(2, 0.20, host="b"), _row(3, 0.50, stage=1)]
    got = find_stragglers(rows, 0.3)
    assert [(s["rank"], s["fastest_rank"]) for s in got] == [(2, 0)]
    assert got[0]["ratio"] == pytest.approx(2.0) and got[0]["host"] == "b"
    # rank 3 alone on its stage; other sample counts are other work
    assert find_stragglers([_row(0, 0.1), _row(1, 0.3, samples=3)], 0.3) == []
    # below the absolute floor: noise of a tiny step
    assert find_stragglers([_row(0, 0.0010), _row(1, 0.0019)], 0.3) == []
    # below 5% of the step: 2 ms more compute in steps of 200 ms (waiting for a slow node)
    assert find_stragglers([_row(0, 0.002, step_s=0.2), _row(1, 0.004, step_s=0.2)],
                           0.3) == []
    assert len(find_stragglers([_row(0, 0.002, step_s=0.2), _row(1, 0.0125, step_s=0.2)],
                               0.3)) == 1
    # a rank that ran no step is no reference
    assert find_stragglers([_row(0, 0.0, steps=0), _row(1, 0.2)], 0.3) == []


def test_watch_names_after_two_reports_in_a_row_and_hosts_of_only_stragglers():
    w = StragglerWatch()
    rows = [_row(0, 0.1), _row(1, 0.1), _row(2, 0.3, host="b"), _row(3, 0.3, host="b")]
    flagged = find_stragglers(rows, 0.3)
    assert [s["rank"] for s in flagged] == [2, 3]
    assert w.update(4, rows, flagged) == (None, [])
    assert w.update(8, rows, []) == (None, [])  # not in a row: starts over
    assert w.update(12, rows, flagged) == (None, [])
    event, recovered = w.update(16, rows, flagged)
    assert event is not None and [d["rank"] for d in event["ranks"]] == [2, 3]
    assert event["hosts"] == ["b"] and event["step"] == 16 and recovered == []
    assert w.update(20, rows, flagged) == (None, [])  # named once
    assert w.update(24, rows, flagged[:1]) == (None, [3])  # rank 3 recovered
    assert w.named == {2}


def test_rank_times_record_round_trip():
    clock = T.PhaseClock()
    t = RankTimes(clock, stage=1, params=1000)
    t.host, t.peak, t.ranks_on_host, t.cores = "node-x", 2e9, 2, 4
    for step in (1, 2, 3):  # the first step is no report's
        clock.wall["optimizer"] = clock.wall.get("optimizer", 0.0) + 0.5
        clock.blocked["backward"] = clock.blocked.get("backward", 0.0) + 0.1
        clock.blocked["agreement"] = clock.blocked.get("agreement", 0.0) + 0.05
        clock.blocked["checkpoint"] = clock.blocked.get("checkpoint", 0.0) + 1.0
        t.data_seconds += 0.01
        t.tokens, t.samples = 64, 2
        t.step(step, 0.6)
    (d,) = unpack_table(t.record(t.window)[None, :])
    assert d["host"] == "node-x" and d["stage"] == 1 and d["steps"] == 2
    assert d["compute_s"] == pytest.approx(0.4) and d["comm_wait_s"] == pytest.approx(0.15)
    assert d["data_s"] == pytest.approx(0.01) and d["samples"] == 2
    assert d["flops_per_s"] == pytest.approx(6 * 1000 * 64 / 0.6)
    assert d["utilisation"] == pytest.approx(d["flops_per_s"] / 2e9)
    (total,) = unpack_table(t.record(t.total)[None, :])
    assert total["steps"] == 3


def test_peak_is_a_matrix_product_rate():
    assert measure_peak_flops("float64", n=64, repeats=2) > 1e7


def test_summary_lines_name_stragglers():
    s = {"rank_times": [{"rank": 0, "host": "a", "stage": 0, "compute_s": 0.1,
                         "comm_wait_s": 0.0, "data_s": 0.0, "checkpoint_s": 0.0,
                         "slowest_step": 3, "slowest_compute_s": 0.2, "flops_per_s": 1e9,
                         "utilisation": 0.02}],
         "speed": {"model_flops_per_token": 6e6, "parameters": 10**6,
                   "achieved_flops_per_s": 1e9, "utilisation": 0.02,
                   "peak_flops_per_s": {"a": 5e10}, "dtype": "float64", "blas_threads": "1",
                   "ranks_on_host": {"a": 4}, "cores": {"a": 2}},
         "stragglers": [{"step": 8, "hosts": ["b"], "reports": 2,
                         "ranks": [{"rank": 1, "host": "b", "ratio": 2.5, "fastest_rank": 0}]}]}
    text = "\n".join(rank_table_lines(s))
    assert "rank 1 (b, 2.50x rank 0)" in text and "slow host(s) b" in text
    assert "4 rank(s) on 2 core(s)" in text and "3 (0.200 s)" in text
    assert rank_table_lines({}) == []


def test_settings_are_checked_before_anything_runs():
    assert parse_trace_steps("10:15") == (10, 15) and parse_trace_steps("7") == (7, 7)
    for bad in ("0:3", "5:4", "a:b", ""):
        with pytest.raises(ValueError, match="trace="):
            parse_trace_steps(bad)
    with pytest.raises(ValueError, match="trace="):
        TrainConfig(trace="3-5")
    with pytest.raises(ValueError, match="elastic"):
        TrainConfig(trace="3:5", strategy="elastic")
    with pytest.raises(ValueError, match="straggler_margin"):
        TrainConfig(straggler_margin=0)
    with pytest.raises(ValueError, match="straggler_interval"):
        TrainConfig(straggler_interval=-1)
    assert slow_spec("1:0.5") == (1, 0.5)
    with pytest.raises(ValueError, match="MPIDIST_TEST_SLOW"):
        slow_spec("1")


def _pipeline_events(p: int, m: int, schedule: str) -> list[dict]:
    """A trace of one step of ``schedule`` run one operation after another on each stage."""
    ev = []
    for stage, order in enumerate(orders(schedule, p, m)):
        t = 10.0 * stage
        ev.append({"ph": "X", "cat": "step", "name": "step 3", "ts": 0.0, "dur": 1e4,
                   "tid": stage * 1000, "pid": 1, "args": {"step": 3}})
        for kind, i, c in order:
            ev.append({"ph": "X", "cat": "pipeline", "name": f"{kind} {i}", "ts": t,
                       "dur": 4.0, "tid": stage * 1000, "pid": 1,
                       "args": {"kind": kind, "micro_batch": i, "chunk": c, "stage": stage}})
            t += 5.0
    return ev


def test_schedule_picture_draws_the_blocks_in_their_order(tmp_path: Path):
    ev = _pipeline_events(3, 4, "zero-bubble")
    rows = schedule_from_trace(ev)
    assert [[(b["kind"], b["micro_batch"], b["chunk"]) for b in r] for r in rows.values()] \
        == orders("zero-bubble", 3, 4)
    png = tmp_path / "s.png"
    assert plot_schedule(rows, str(png), schedule="zero-bubble", micro_batches=4, step=3)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert schedule_from_trace([]) == {}


def _tiny(out: Path, **kw) -> TrainConfig:
    return TrainConfig(out=str(out), steps=6, n_layer=1, n_head=2, n_embd=16, block_size=8,
                       global_batch=4, eval_interval=0, eval_batches=1,
                       checkpoint_interval=0, progress=False, **kw)


def _steps_recorded(cfg: TrainConfig) -> set[int]:
    """The steps in which a timeline recorder was active or installed as a hook."""
    from mpidist.run import run_training

    seen: set[int] = set()

    def look() -> None:
        step, name = calls.step_phase()
        if name == "forward" and (T.active() is not None
                                  or any(isinstance(h, T.Recorder) for h in calls.hooks())):
            seen.add(step)

    calls.add_context_hook(look)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            run_training(cfg, comms.mpi().COMM_SELF)
    finally:
        calls.remove_context_hook(look)
    return seen


def test_without_trace_nothing_is_recorded_with_one_only_its_steps(tmp_path: Path):
    assert _steps_recorded(_tiny(tmp_path / "off")) == set()
    assert not (tmp_path / "off" / "trace.json").exists()
    assert _steps_recorded(_tiny(tmp_path / "on", trace="3:4")) == {3, 4}
    trace = json.loads((tmp_path / "on" / "trace.json").read_text())
    steps = sorted(e["args"]["step"] for e in trace["traceEvents"] if e.get("cat") == "step")
    assert steps == [3, 4]
    summary = json.loads((tmp_path / "on" / "summary.json").read_text())
    (row,) = summary["rank_times"]
    assert row["steps"] == 6 and row["compute_s"] > 0 and summary["stragglers"] == []
    assert summary["speed"]["peak_flops_per_s"][row["host"]] > 0
    assert np.isfinite(summary["speed"]["utilisation"])
