"""Per-rank times, straggler reports and achieved speed of ``mpidist train``.

Every rank keeps, step by step (:class:`RankTimes`, fed by the always-on
:class:`~mpidist.core.timeline.PhaseClock` hook):

- **compute**: the optimizer step's wall time (the "optimizer" phase: forward, backward,
  update) less the time its main thread was blocked in MPI inside it;
- **communication wait**: time blocked in MPI outside checkpoints and evaluation: blocking
  calls, and waits for nonblocking ones (a nonblocking collective that completes while the
  rank computes costs no wait: that time is overlapped);
- **data**: loading the step's batch; **checkpoint**: wall time in checkpoint work.

Every ``--straggler-interval`` steps the ranks exchange these sums (over the steps since the
last report; the run's first step, which compiles and warms caches, in none) in one
``Allgather`` of a small record (about 200 bytes a rank) and each rank (all alike, from the
same table) scores every rank's compute time per step against the fastest rank doing the
same work: the ranks of the same pipeline stage with the same number of samples per step.
A rank whose compute time exceeds that fastest rank's by more than ``--straggler-margin``
(and by more than :data:`MIN_EXCESS_S` and :data:`MIN_EXCESS_SHARE` of the step's wall
time: an excess that delays the step by less is no news, whatever its ratio to a tiny
compute time) in two reports in a row is named: an event in ``events.jsonl``, a note on
the progress line, a warning, and the summary; a host is named when every rank it runs
is. A named rank that falls back within the margin is reported recovered.

Achieved speed: a step's model FLOPs are the planner's count, ``6 x parameters x tokens``,
each rank's share ``6 x its stage's (tensor-parallel) parameters x its tokens``; utilisation
is against a peak measured on the machine at the start (:func:`measure_peak_flops`: a matrix
product on one core, measured by one rank per host while the host's others sleep), with how
many ranks share the host's cores.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["FIELDS", "MIN_EXCESS_S", "MIN_EXCESS_SHARE", "RankTimes", "StragglerWatch",
           "blas_threads", "find_stragglers", "measure_peak_flops", "rank_table_lines",
           "unpack_table"]

log = logging.getLogger("mpidist.cli.train")

#: a rank's record in the exchange (float64 each), followed by its host's name
FIELDS = ("compute", "comm_wait", "data", "checkpoint", "steps", "step_seconds", "flops",
          "slowest_compute", "slowest_step", "stage", "samples", "peak", "ranks_on_host",
          "cores")
_HOST_BYTES = 64
#: the least excess compute time per step (seconds) for which a rank is named
MIN_EXCESS_S = 0.001
#: ... and the least as a fraction of the step's wall time (an excess that delays every
#: step by less than this is no news, whatever its ratio to a tiny compute time)
MIN_EXCESS_SHARE = 0.05
#: phases whose blocked time is part of the optimizer step (the rest is between steps)
STEP_PHASES = ("optimizer", "forward", "backward", "pipeline", "update", "allgather")
#: phases whose blocked time is not communication wait (counted as their own work)
_NOT_WAIT = ("checkpoint", "evaluation", "recovery")


def measure_peak_flops(dtype: Any = "float64", *, n: int = 384, repeats: int = 5,
                       xp: Any = np) -> float:
    """FLOP/s of the best of ``repeats`` ``n x n`` matrix products in ``dtype`` (NumPy's:
    one core with one BLAS thread when ``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS`` is 1;
    a GPU's through CuPy when ``xp`` is CuPy). Not collective."""
    rng = np.random.default_rng(0)
    a = xp.asarray(rng.standard_normal((n, n)).astype(dtype))
    b = xp.asarray(rng.standard_normal((n, n)).astype(dtype))
    c = xp.empty_like(a)
    sync = getattr(getattr(xp, "cuda", None), "Device", None)
    best = float("inf")
    for _ in range(repeats + 1):  # (the first warms up)
        t0 = time.perf_counter()
        xp.matmul(a, b, out=c)
        if sync is not None:
            sync().synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best if best > 0 else 0.0


def blas_threads() -> str:
    """The BLAS thread count the environment asks for ("default" when it says none)."""
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if os.environ.get(name):
            return os.environ[name]
    return "default"


@dataclass
class _Sums:
    compute: float = 0.0
    comm_wait: float = 0.0
    data: float = 0.0
    checkpoint: float = 0.0
    steps: int = 0
    step_seconds: float = 0.0
    flops: float = 0.0
    samples: int = 0

    def add(self, other: _Sums) -> None:
        for k in vars(self):
            setattr(self, k, getattr(self, k) + getattr(other, k))


class RankTimes:
    """This rank's times, step by step, from a :class:`~mpidist.core.timeline.PhaseClock`
    (see the module docstring). Not collective but :meth:`exchange`."""

    def __init__(self, clock: Any, *, stage: int = 0, params: int = 0) -> None:
        self.clock = clock
        self.stage, self.params = int(stage), int(params)
        self.host = socket.gethostname()
        self.peak = 0.0  # this host's measured peak (only the rank that measured it knows)
        self.ranks_on_host, self.cores = 1, os.cpu_count() or 1
        self.total, self.window = _Sums(), _Sums()
        self.slowest = (0.0, 0)  # (compute seconds, step)
        self.data_seconds = 0.0
        self.warm = False
        self.tokens = self.samples = 0  # of the last batch loaded
        self._last = self._read()

    def _read(self) -> tuple[float, float, float, float, float]:
        b, w = self.clock.blocked, self.clock.wall
        return (w.get("optimizer", 0.0), sum(b.get(p, 0.0) for p in STEP_PHASES),
                sum(v for k, v in b.items() if k not in _NOT_WAIT), w.get("checkpoint", 0.0),
                self.data_seconds)

    def step(self, step: int, seconds: float) -> None:
        """Step ``step`` ended (``seconds``: its wall time, data loading included): what
        it took since the previous step ended. Not collective."""
        now = self._read()
        d = [a - b for a, b in zip(now, self._last, strict=True)]
        self._last = now
        one = _Sums(compute=max(d[0] - d[1], 0.0), comm_wait=d[2], data=d[4],
                    checkpoint=d[3], steps=1, step_seconds=seconds,
                    flops=6.0 * self.params * self.tokens, samples=self.samples)
        self.total.add(one)
        if self.warm:  # (the run's first step compiles and warms caches: no report's)
            self.window.add(one)
        self.warm = True
        if one.compute > self.slowest[0]:
            self.slowest = (one.compute, int(step))

    def flush(self) -> None:
        """Count what came after the last step (the final checkpoint, evaluation's
        communication) in the run's totals, as no step's. Not collective."""
        now = self._read()
        d = [a - b for a, b in zip(now, self._last, strict=True)]
        self._last = now
        self.total.add(_Sums(comm_wait=d[2], checkpoint=d[3], data=d[4]))

    def record(self, sums: _Sums) -> np.ndarray:
        """This rank's record for the exchange (uint8: :data:`FIELDS` then its host)."""
        values = [sums.compute, sums.comm_wait, sums.data, sums.checkpoint, sums.steps,
                  sums.step_seconds, sums.flops, self.slowest[0], self.slowest[1],
                  self.stage, sums.samples / max(sums.steps, 1), self.peak,
                  self.ranks_on_host, self.cores]
        out = np.zeros(len(FIELDS) * 8 + _HOST_BYTES, dtype=np.uint8)
        out[:len(FIELDS) * 8] = np.asarray(values, dtype=np.float64).view(np.uint8)
        host = self.host.encode()[:_HOST_BYTES]
        out[len(FIELDS) * 8:len(FIELDS) * 8 + len(host)] = np.frombuffer(host, np.uint8)
        return out

    def exchange(self, comm: Any, *, total: bool = False) -> list[dict[str, Any]]:
        """Every rank's record (of the window since the last exchange, or of the whole
        run), in rank order; the window starts anew. Collective over ``comm`` (one
        ``Allgather``; None or one rank: this rank's alone)."""
        mine = self.record(self.total if total else self.window)
        if not total:
            self.window = _Sums()
        if comm is None or comm.Get_size() == 1:
            return unpack_table(mine[None, :])
        table = np.zeros((comm.Get_size(), mine.size), dtype=np.uint8)
        comm.Allgather(mine, table)
        return unpack_table(table)


def unpack_table(table: np.ndarray) -> list[dict[str, Any]]:
    """The exchange's rows as dicts: rank, host, per-step means (``compute_s``,
    ``comm_wait_s``, ``data_s``, ``checkpoint_s``), the raw :data:`FIELDS`, and this
    host's peak FLOP/s (the one measurement among the host's rows). Pure."""
    rows = []
    for r, row in enumerate(table):
        v = row[:len(FIELDS) * 8].copy().view(np.float64)
        d: dict[str, Any] = dict(zip(FIELDS, (float(x) for x in v), strict=True))
        d["rank"] = r
        d["host"] = bytes(row[len(FIELDS) * 8:]).rstrip(b"\0").decode(errors="replace")
        n = max(d["steps"], 1.0)
        for k in ("compute", "comm_wait", "data", "checkpoint"):
            d[f"{k}_s"] = d[k] / n
        rows.append(d)
    peaks: dict[str, float] = {}
    for d in rows:
        peaks[d["host"]] = max(peaks.get(d["host"], 0.0), d["peak"])
    for d in rows:
        d["peak"] = peaks[d["host"]]
        d["flops_per_s"] = d["flops"] / d["step_seconds"] if d["step_seconds"] > 0 else 0.0
        d["utilisation"] = d["flops_per_s"] / d["peak"] if d["peak"] > 0 else 0.0
    return rows


# -- stragglers ----------------------------------------------------------------------------------
def find_stragglers(rows: Sequence[dict[str, Any]], margin: float,
                    min_excess: float = MIN_EXCESS_S, min_share: float = MIN_EXCESS_SHARE
                    ) -> list[dict[str, Any]]:
    """The ranks of ``rows`` (:func:`unpack_table`'s) whose compute time per step exceeds
    the fastest rank's of their group (same ``stage``, same ``samples`` per step) by more
    than ``margin`` (a fraction), by more than ``min_excess`` seconds and by more than
    ``min_share`` of the fastest rank's step (wall time per step): for each,
    ``{"rank", "host", "compute_s", "fastest_rank", "fastest_s", "ratio"}``. Ranks that
    ran no step, and ranks alone in their group, are never named. Pure."""
    groups: dict[tuple[float, float], list[dict[str, Any]]] = {}
    for d in rows:
        if d["steps"] > 0:
            groups.setdefault((d["stage"], round(d["samples"], 6)), []).append(d)
    out = []
    for members in groups.values():
        if len(members) < 2:
            continue
        best = min(members, key=lambda d: (d["compute_s"], d["rank"]))
        floor = max(min_excess, min_share * best["step_seconds"] / best["steps"])
        for d in members:
            excess = d["compute_s"] - best["compute_s"]
            if d is not best and excess > floor \
                    and d["compute_s"] > best["compute_s"] * (1.0 + margin):
                out.append({"rank": d["rank"], "host": d["host"], "compute_s": d["compute_s"],
                            "fastest_rank": best["rank"], "fastest_s": best["compute_s"],
                            "ratio": d["compute_s"] / best["compute_s"]
                            if best["compute_s"] > 0 else float("inf")})
    return sorted(out, key=lambda s: s["rank"])


class StragglerWatch:
    """Names ranks flagged by :func:`find_stragglers` in ``reports`` reports in a row (and
    hosts all of whose compared ranks are named); remembers who is named. Pure."""

    def __init__(self, reports: int = 2) -> None:
        self.reports = reports
        self.streak: dict[int, int] = {}
        self.named: set[int] = set()
        self.history: list[dict[str, Any]] = []

    def update(self, step: int, rows: Sequence[dict[str, Any]], flagged: list[dict[str, Any]]
               ) -> tuple[dict[str, Any] | None, list[int]]:
        """One report: (the naming event of ranks named now, or None; the named ranks that
        recovered)."""
        now = {s["rank"]: s for s in flagged}
        self.streak = {r: self.streak.get(r, 0) + 1 for r in now}
        recovered = sorted(r for r in self.named if r not in now)
        self.named -= set(recovered)
        new = [now[r] for r in sorted(now) if self.streak[r] >= self.reports
               and r not in self.named]
        if not new:
            return None, recovered
        self.named |= {s["rank"] for s in new}
        compared = {d["rank"]: d["host"] for d in rows if d["steps"] > 0}
        hosts = sorted({h for h in compared.values()
                        if all(r in self.named for r, hh in compared.items() if hh == h)})
        event = {"step": int(step), "ranks": new, "hosts": hosts, "reports": self.reports}
        self.history.append(event)
        return event, recovered


# -- the summary ---------------------------------------------------------------------------------
def rank_table_lines(s: dict[str, Any]) -> list[str]:
    """The summary's per-rank table, speed and stragglers as text lines (``s``: the
    summary's ``rank_times``, ``speed`` and ``stragglers``; none when it has no
    ``rank_times``). Pure."""
    rows = s.get("rank_times")
    if not rows:
        return []
    lines = ["per-rank times (s per step; compute: not blocked in MPI; slowest step by "
             "compute)",
             "  rank  host            stage  compute  comm-wait    data  checkpoint  "
             "slowest step      GFLOP/s   util"]
    for d in rows:
        slow = f"{int(d['slowest_step'])} ({d['slowest_compute_s']:.3f} s)"
        lines.append(f"  {d['rank']:>4}  {d['host'][:14]:<14}  {int(d['stage']):>5}  "
                     f"{d['compute_s']:7.3f}  {d['comm_wait_s']:9.3f}  {d['data_s']:6.3f}  "
                     f"{d['checkpoint_s']:10.3f}  {slow:<16}  {d['flops_per_s'] / 1e9:7.2f}  "
                     f"{100 * d['utilisation']:4.1f}%")
    sp = s.get("speed") or {}
    if sp:
        peaks = ", ".join(f"{h} {p / 1e9:.1f} GFLOP/s ({sp['ranks_on_host'][h]} rank(s) on "
                          f"{sp['cores'][h]} core(s))" for h, p in sp["peak_flops_per_s"].items())
        lines.append(f"speed                 {sp['model_flops_per_token'] / 1e6:.2f} MFLOP per "
                     f"token (6 x {sp['parameters']:,} parameters); achieved "
                     f"{sp['achieved_flops_per_s'] / 1e9:.2f} GFLOP/s in all, "
                     f"{100 * sp['utilisation']:.1f}% of the ranks' peaks")
        lines.append(f"peak per core         {peaks}; {sp['dtype']} matrix product, BLAS "
                     f"threads {sp['blas_threads']}")
    named = s.get("stragglers") or []
    if not named:
        lines.append("stragglers            none named")
    for ev in named:
        who = ", ".join(f"rank {d['rank']} ({d['host']}, {d['ratio']:.2f}x rank "
                        f"{d['fastest_rank']})" for d in ev["ranks"])
        hosts = f"; slow host(s) {', '.join(ev['hosts'])}" if ev["hosts"] else ""
        lines.append(f"stragglers            step {ev['step']}: {who}{hosts}")
    return lines
