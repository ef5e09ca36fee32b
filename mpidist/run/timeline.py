"""Why a run is slow, for ``mpidist train``: per-rank times, straggler reports, achieved
speed (:mod:`mpidist.run.stragglers`) and the trace window (:mod:`mpidist.run.trace`).

:class:`RunTimeline` is one run's: ``begin`` before the first step, ``after_step`` (a loop
hook that runs before the run's own, so that a report reaches the step's metrics row),
``tail`` (a loop hook that runs last: the trace window opens and closes between steps),
``data`` (the training data, its batches timed) and ``finish`` (the summary's fields).

``MPIDIST_TEST_SLOW="R:SECONDS"`` makes world rank R sleep SECONDS in every training step
(when its first forward begins: inside the step's computation), for the straggler tests.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from mpidist.core import calls, comms
from mpidist.core.timeline import PhaseClock, active, record
from mpidist.run.stragglers import (
    RankTimes,
    StragglerWatch,
    blas_threads,
    find_stragglers,
    measure_peak_flops,
)
from mpidist.run.trace import (
    SCHEDULE_NAME,
    TraceWindow,
    host_names,
    parse_trace_steps,
    plot_schedule,
    schedule_from_trace,
)

__all__ = ["RunTimeline", "slow_spec"]

log = logging.getLogger("mpidist.cli.train")


def slow_spec(text: str) -> tuple[int, float]:
    """``MPIDIST_TEST_SLOW``'s ``"R:SECONDS"`` as ``(R, SECONDS)``; ValueError naming the
    text when it is malformed. Pure."""
    rank, colon, seconds = text.strip().partition(":")
    try:
        r, s = int(rank), float(seconds)
    except ValueError:
        r, s = -1, -1.0
    if not colon or r < 0 or not s >= 0:
        raise ValueError(f"MPIDIST_TEST_SLOW={text!r}: expected RANK:SECONDS")
    return r, s


class _TimedData:
    """The training data, each ``batch`` timed (and a block of the trace)."""

    def __init__(self, data: Any, owner: RunTimeline) -> None:
        self._data, self._owner = data, owner

    def batch(self, idx: Any) -> Any:
        t0 = time.monotonic()
        self._owner.step_t0 = t0
        x, y = self._data.batch(idx)
        t1 = time.monotonic()
        times = self._owner.times
        if times is not None:
            times.data_seconds += t1 - t0
            times.tokens, times.samples = int(np.asarray(y).size), len(idx)
        record("data", "data", t0, t1, samples=len(idx))
        return x, y

    def __len__(self) -> int:
        return len(self._data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._data, name)


class _Tail:
    """The loop hook that runs last: the trace window between steps."""

    def __init__(self, owner: RunTimeline) -> None:
        self.between_steps = owner.window_between_steps


class RunTimeline:
    """One run's per-rank times, straggler reports, speed and trace window (see the module
    docstring). ``run`` is the run (its ``job_comm()``, ``events``, ``progress``,
    ``is_root()``)."""

    def __init__(self, cfg: Any, run: Any) -> None:
        self.cfg, self.run = cfg, run
        self.clock = PhaseClock()
        self.times: RankTimes | None = None
        self.watch = StragglerWatch()
        self.window = TraceWindow(*parse_trace_steps(cfg.trace), cfg.out) if cfg.trace \
            else None
        self.tail = _Tail(self)
        self.fields: dict[str, Any] = {}  # what this step's metrics row adds
        self.step_t0 = 0.0
        self.parameters = 0
        self.dtype = cfg.dtype
        self._slow_hook: Any = None
        self._slow = slow_spec(os.environ["MPIDIST_TEST_SLOW"]) \
            if os.environ.get("MPIDIST_TEST_SLOW", "").strip() else None

    def data(self, data: Any) -> Any:
        """``data`` with its batches timed."""
        return _TimedData(data, self)

    # -- the start ----------------------------------------------------------------------------
    def begin(self, model: Any, comm: Any, start: int, *, joiner: bool = False) -> None:
        """Start the clock, measure the peak (one rank per host), open the trace window if
        it starts with the first step. Collective over ``comm`` (a joiner of an elastic job
        only starts its clock)."""
        comms.add_hook(self.clock)
        placement = getattr(model, "placement", None)
        local = getattr(getattr(model, "layout", None), "numel", 0)
        self.parameters = int(getattr(getattr(placement, "global_layout", None), "numel", 0))
        self.times = RankTimes(self.clock, stage=int(getattr(model, "stage", 0)),
                               params=local)
        self.dtype = str(np.dtype(getattr(model, "dtype", self.cfg.dtype)))
        if self._slow is not None:
            self._install_slow(*self._slow)
        if joiner:
            return
        self._measure_peak(self.times, comm, getattr(model, "xp", np))
        if self.window is not None and self.window.due(start + 1):
            self.window.start(comm)

    def _measure_peak(self, times: RankTimes, comm: Any, xp: Any) -> None:
        """The lowest rank of each host measures the peak while the host's other ranks
        sleep in a nonblocking barrier (so that it has a core to itself). Collective."""
        hosts = host_names(comm)
        _, rank = comms.size_rank(comm)
        mine = hosts[rank]
        times.ranks_on_host = hosts.count(mine)
        if hosts.index(mine) == rank:
            times.peak = measure_peak_flops(self.dtype, xp=xp)
        if comm is not None and comm.Get_size() > 1:
            req = comm.Ibarrier()
            while not calls.test_all([req]):
                time.sleep(0.001)

    def _install_slow(self, rank: int, seconds: float) -> None:
        if comms.mpi().COMM_WORLD.Get_rank() != rank:
            return
        last = [-1]

        def slow() -> None:
            step, name = calls.step_phase()
            if name == "forward" and step != last[0]:
                last[0] = step
                time.sleep(seconds)

        calls.add_context_hook(slow)
        self._slow_hook = slow

    def close(self) -> None:
        """Remove this run's hooks from the process (after the run, or when it failed: an
        open trace window is dropped). Not collective."""
        comms.remove_hook(self.clock)
        rec = active()
        if rec is not None and self.window is not None and rec is self.window.recorder:
            rec.stop()
        if self._slow_hook is not None:
            calls.remove_context_hook(self._slow_hook)
            self._slow_hook = None

    # -- each step ---------------------------------------------------------------------------
    def after_step(self, model: Any, rec: Any) -> None:
        """The step's times; every ``--straggler-interval`` steps the ranks' report
        (collective over the run's communicator)."""
        times = self.times
        if times is None:
            return
        times.step(rec.step, rec.seconds)
        if active() is not None:
            record(f"step {rec.step}", "step", self.step_t0, time.monotonic(), step=rec.step)
        self.fields = {}
        n = self.cfg.straggler_interval
        if n and rec.step % n == 0:
            self._report(rec.step, times.exchange(self.run.job_comm()))

    def _report(self, step: int, rows: list[dict[str, Any]]) -> None:
        flagged = find_stragglers(rows, self.cfg.straggler_margin)
        event, recovered = self.watch.update(step, rows, flagged)
        self.fields = {"ranks": {k: [round(d[k], 6) for d in rows] for k in
                                 ("compute_s", "comm_wait_s", "data_s", "checkpoint_s",
                                  "flops_per_s")},
                       "stragglers": sorted(self.watch.named)}
        root = self.run.is_root()
        for r in recovered:
            self.run.events.write(event="straggler_recovered", step=step, rank=r,
                                  time=time.time())
        progress = getattr(self.run, "progress", None)
        if progress is not None:
            progress.note = _note(self.watch.named, rows)
        if event is None:
            return
        self.run.events.write(event="straggler", **event, margin=self.cfg.straggler_margin,
                              time=time.time())
        if root:
            for d in event["ranks"]:
                log.warning("straggler: rank %d on %s computes %.3f s a step, %.2fx the "
                            "fastest rank doing the same work (rank %d, %.3f s), %d reports "
                            "in a row", d["rank"], d["host"], d["compute_s"], d["ratio"],
                            d["fastest_rank"], d["fastest_s"], event["reports"])
            for h in event["hosts"]:
                log.warning("straggler: host %s (every rank on it is named)", h)

    def window_between_steps(self, model: Any, rec: Any) -> Any:
        """Open or close the trace window (collective over the run's communicator)."""
        w = self.window
        if w is None:
            return model
        if w.recording and rec.step >= w.last:
            self._close_window(w)
        elif w.due(rec.step + 1):
            w.start(self.run.job_comm())
        return model

    def mesh_changed(self, model: Any, changed: Any) -> None:
        """After in-job recovery from a lost rank: an open trace window is dropped (its
        ranks are not all there to write it). Not collective."""
        w = self.window
        if w is not None and w.recording and w.recorder is not None:
            w.recorder.stop()
            w.recorder = None
            w.done = True
            if self.run.is_root():
                log.warning("the trace of steps %d-%d is dropped: a rank was lost in it",
                            w.first, w.last)

    def _close_window(self, w: TraceWindow) -> None:
        labels = {comms.comm_id(c): i.label for c in comms.live()
                  if (i := comms.info(c)) is not None and i.label}
        path = w.stop(self.run.job_comm(), labels)
        if path is not None:
            log.info("trace of steps %d-%d written: %s (open it in https://ui.perfetto.dev)",
                     w.first, w.last, path)

    # -- the end ---------------------------------------------------------------------------------
    def finish(self, comm: Any) -> dict[str, Any]:
        """Close an open trace window, draw the pipeline schedule (rank 0), and return the
        summary's ``rank_times``, ``speed`` and ``stragglers``. Collective over ``comm``."""
        if self.window is not None and self.window.recording:
            self._close_window(self.window)
        self._draw_schedule()
        times = self.times
        if times is None:
            return {}
        times.flush()
        rows = times.exchange(comm, total=True)
        comms.remove_hook(self.clock)
        keep = ("rank", "host", "stage", "steps", "compute_s", "comm_wait_s", "data_s",
                "checkpoint_s", "flops_per_s", "utilisation")
        table = [{**{k: d[k] for k in keep}, "slowest_step": int(d["slowest_step"]),
                  "slowest_compute_s": d["slowest_compute"]} for d in rows]
        peaks = {d["host"]: d["peak"] for d in rows}
        seconds = max((d["step_seconds"] for d in rows), default=0.0)
        flops = sum(d["flops"] for d in rows)
        peak_all = sum(peaks[d["host"]] for d in rows)
        speed = {"model_flops_per_token": 6 * self.parameters, "parameters": self.parameters,
                 "achieved_flops_per_s": flops / seconds if seconds > 0 else 0.0,
                 "utilisation": flops / seconds / peak_all if seconds > 0 and peak_all else 0.0,
                 "peak_flops_per_s": peaks, "dtype": self.dtype, "blas_threads": blas_threads(),
                 "ranks_on_host": {d["host"]: int(d["ranks_on_host"]) for d in rows},
                 "cores": {d["host"]: int(d["cores"]) for d in rows}}
        return {"rank_times": table, "speed": speed, "stragglers": list(self.watch.history)}

    def _draw_schedule(self) -> None:
        w, cfg = self.window, self.cfg
        if w is None or not w.events or cfg.pp <= 1:
            return
        rows = schedule_from_trace(w.events)
        step = max((e["args"]["step"] for e in w.events if e.get("cat") == "step"), default=0)
        try:
            plot_schedule(rows, os.path.join(cfg.out, SCHEDULE_NAME), schedule=cfg.schedule,
                          micro_batches=cfg.micro_batches, virtual_stages=cfg.virtual_stages,
                          step=step)
        except Exception as exc:  # noqa: BLE001 - a picture must not fail the run
            log.warning("no schedule plot: %s: %s", type(exc).__name__, exc)


def _note(named: set[int], rows: list[dict[str, Any]]) -> str:
    """The progress line's note about the ranks named now."""
    if not named:
        return ""
    hosts = {d["rank"]: d["host"] for d in rows}
    return "straggler " + ", ".join(f"rank {r} ({hosts.get(r, '?')})" for r in sorted(named))
