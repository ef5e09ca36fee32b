"""``mpidist train --trace FIRST:LAST``: a Chrome/Perfetto trace of every rank's steps, and a
picture of the pipeline schedule as it ran.

For the steps FIRST to LAST (both included) every rank records with
:class:`mpidist.core.timeline.Recorder`: its steps, data loading, forward and backward of
every unit (and pipeline operation: F, B, W, BW of a micro-batch and chunk), the optimizer's
gradient sync, update and parameter allgather, the phases (checkpoint, evaluation, the
between-steps agreement) and every MPI call (operation, communicator and its label, bytes,
start and end). At the window's start the ranks measure their clocks against rank 0's
(:func:`mpidist.core.timeline.align`); at its end rank 0 gathers every rank's events and
writes ``OUT/trace.json`` in the Chrome trace event format: one process per host (its ranks
grouped under it), a track per rank (and per other thread, and per overlapping nonblocking
call), times in microseconds on rank 0's clock. It opens in https://ui.perfetto.dev and
chrome://tracing. ``otherData.mpidist`` says each rank's measured clock offset and the bound
within which the ranks' times are aligned.

For a pipeline (pp > 1) rank 0 also draws ``OUT/schedule.png`` from the trace: a row per
stage, the last traced step's F, B, W and BW blocks coloured, the gaps between them the
bubble, with the bubble measured and the bubble the schedule's simulation predicts from the
measured block times (:func:`mpidist.parallel.schedules.simulate`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Iterable
from typing import Any

import numpy as np

from mpidist.core import comms
from mpidist.core.timeline import Alignment, Recorder, align

__all__ = ["FORMAT", "SCHEDULE_NAME", "TRACE_NAME", "TraceWindow", "host_names",
           "parse_trace_steps", "plot_schedule", "schedule_from_trace"]

log = logging.getLogger("mpidist.cli.train")

TRACE_NAME = "trace.json"
SCHEDULE_NAME = "schedule.png"
#: ``otherData.mpidist.format`` of the trace
FORMAT = "mpidist-trace/1"
_HOST_BYTES = 64
_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "BW": "#c44e52"}


def parse_trace_steps(text: str) -> tuple[int, int]:
    """``"10:15"`` as ``(10, 15)`` (both included), ``"12"`` as ``(12, 12)``. ValueError
    naming the text unless FIRST and LAST are steps (>= 1) with FIRST <= LAST. Pure."""
    first, colon, last = str(text).strip().partition(":")
    try:
        a = int(first)
        b = int(last) if colon else a
    except ValueError:
        a = b = 0
    if a < 1 or b < a:
        raise ValueError(f"trace={text!r}: expected FIRST:LAST, the steps to trace "
                         "(e.g. 10:15; steps count from 1)")
    return a, b


class TraceWindow:
    """The trace window of one run: :meth:`start` and :meth:`stop` are collective over the
    run's communicator, at the same step boundary on every rank."""

    def __init__(self, first: int, last: int, out: str) -> None:
        self.first, self.last, self.out = first, last, out
        self.recorder: Recorder | None = None
        self.alignment = Alignment()
        self.done = False
        self.hosts: list[str] = []
        self.events: list[dict[str, Any]] = []  # rank 0: the merged trace, once stopped

    @property
    def recording(self) -> bool:
        return self.recorder is not None

    def due(self, next_step: int) -> bool:
        """Whether recording should start before step ``next_step`` runs."""
        return not self.done and self.recorder is None and \
            self.first <= next_step <= self.last

    def start(self, comm: Any) -> None:
        """Learn the hosts, align the clocks, record. Collective over ``comm``."""
        self.hosts = host_names(comm)
        self.alignment = align(comm)
        self.recorder = Recorder()
        self.recorder.start()

    def stop(self, comm: Any, labels: dict[str, str]) -> str | None:
        """Stop recording; rank 0 gathers every rank's events and writes the trace.
        Collective over ``comm``. Returns the trace's path on rank 0 (None elsewhere)."""
        rec = self.recorder
        if rec is None:
            return None
        rec.stop()
        self.recorder = None
        self.done = True
        size, rank = comms.size_rank(comm)
        order = list(dict.fromkeys(self.hosts))
        pid = order.index(self.hosts[rank]) + 1
        a = self.alignment
        mine = {"rank": rank, "host": self.hosts[rank], "pid": pid, "offset_s": a.offset,
                "rtt_s": a.rtt, "bound_s": a.bound, "skew_s": a.skew,
                "events": rec.chrome(rank=rank, pid=pid, alignment=a, labels=labels)}
        parts = _gather_bytes(json.dumps(mine).encode(), comm)
        if rank != 0:
            return None
        ranks = [json.loads(p) for p in parts]
        self.events = _process_metadata(order, self.hosts) + \
            [e for r in ranks for e in r.pop("events")]
        info = {"format": FORMAT, "steps": [self.first, self.last], "world_size": size,
                "clock": "each rank's time.monotonic(), moved onto rank 0's by the offset "
                         "measured at the window's start (exact within bound_s)",
                "alignment_bound_s": max(r["bound_s"] for r in ranks), "ranks": ranks}
        path = os.path.join(self.out, TRACE_NAME)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write('{"displayTimeUnit": "ms", "otherData": {"mpidist": ')
            json.dump(info, f)
            f.write('}, "traceEvents": [\n')
            f.write(",\n".join(json.dumps(e) for e in self.events))
            f.write("\n]}\n")
        os.replace(path + ".tmp", path)
        return path


def host_names(comm: Any) -> list[str]:
    """Every rank's host name, in rank order. Collective over ``comm``."""
    mine = np.zeros(_HOST_BYTES, dtype=np.uint8)
    name = socket.gethostname().encode()[:_HOST_BYTES]
    mine[:len(name)] = np.frombuffer(name, dtype=np.uint8)
    size, _ = comms.size_rank(comm)
    if size == 1:
        return [socket.gethostname()]
    table = np.zeros((size, _HOST_BYTES), dtype=np.uint8)
    comm.Allgather(mine, table)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in table]


def _gather_bytes(data: bytes, comm: Any) -> list[bytes]:
    """Every rank's ``data`` on rank 0 (empty elsewhere). Collective over ``comm``."""
    size, rank = comms.size_rank(comm)
    if size == 1:
        return [data]
    n = np.array([len(data)], dtype=np.int64)
    counts = np.zeros(size, dtype=np.int64)
    comm.Gather(n, counts, root=0)
    send = np.frombuffer(data, dtype=np.uint8)
    if rank != 0:
        comm.Gatherv(send, None, root=0)
        return []
    recv = np.zeros(int(counts.sum()), dtype=np.uint8)
    comm.Gatherv(send, [recv, counts], root=0)
    edges = np.concatenate([[0], np.cumsum(counts)])
    return [recv[edges[i]:edges[i + 1]].tobytes() for i in range(size)]


def _process_metadata(order: list[str], hosts: list[str]) -> list[dict[str, Any]]:
    out = []
    for k, host in enumerate(order):
        ranks = [r for r, h in enumerate(hosts) if h == host]
        out += [{"name": "process_name", "ph": "M", "pid": k + 1, "tid": 0,
                 "args": {"name": f"host {host}"}},
                {"name": "process_labels", "ph": "M", "pid": k + 1, "tid": 0,
                 "args": {"labels": "ranks " + ", ".join(map(str, ranks))}},
                {"name": "process_sort_index", "ph": "M", "pid": k + 1, "tid": 0,
                 "args": {"sort_index": k}}]
    return out


# -- the pipeline schedule as it ran -------------------------------------------------------------
def schedule_from_trace(events: Iterable[dict[str, Any]], step: int | None = None
                        ) -> dict[int, list[dict[str, Any]]]:
    """The pipeline blocks of one traced step (the last one when ``step`` is None) per stage,
    each stage's taken from its lowest rank, in the order they ran: ``{stage: [{"kind",
    "micro_batch", "chunk", "ts", "dur"}, ...]}`` (microseconds). Pure."""
    events = list(events)
    steps: dict[int, list[tuple[int, float, float]]] = {}  # rank -> (step, start, end)
    blocks: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        rank = e["tid"] // 1000
        if e["cat"] == "step":
            steps.setdefault(rank, []).append((e["args"]["step"], e["ts"], e["ts"] + e["dur"]))
        elif e["cat"] == "pipeline":
            blocks.setdefault(rank, []).append(e)
    if not steps:
        return {}
    want = max(s for spans in steps.values() for s, _, _ in spans) if step is None else step
    out: dict[int, list[dict[str, Any]]] = {}
    for rank in sorted(blocks):
        span = [(a, b) for s, a, b in steps.get(rank, []) if s == want]
        if not span:
            continue
        a, b = span[0]
        mine = sorted((e for e in blocks[rank] if a <= e["ts"] <= b), key=lambda e: e["ts"])
        if not mine:
            continue
        stage = int(mine[0]["args"]["stage"])
        if stage not in out:
            out[stage] = [{"kind": e["args"]["kind"], "micro_batch": e["args"]["micro_batch"],
                           "chunk": e["args"]["chunk"], "ts": e["ts"], "dur": e["dur"]}
                          for e in mine]
    return dict(sorted(out.items()))


def _bubbles(rows: dict[int, list[dict[str, Any]]], schedule: str, m: int, v: int
             ) -> tuple[float, float | None]:
    """(the measured bubble: the stages' idle fraction between the step's first and last
    block; the bubble the schedule's simulation predicts from the mean F, B, W times)."""
    from mpidist.parallel.schedules import orders, simulate

    start = min(b["ts"] for r in rows.values() for b in r)
    end = max(b["ts"] + b["dur"] for r in rows.values() for b in r)
    busy = sum(b["dur"] for r in rows.values() for b in r)
    measured = 1.0 - busy / (len(rows) * (end - start)) if end > start else 0.0
    mean = {}
    for kind in ("F", "B", "W", "BW"):
        d = [b["dur"] for r in rows.values() for b in r if b["kind"] == kind]
        mean[kind] = float(np.mean(d)) if d else 0.0
    try:
        sim = simulate(orders(schedule, len(rows), m, v), f=mean["F"],
                       b=mean["B"] or mean["BW"], w=mean["W"])
    except ValueError:
        return measured, None
    return measured, sim.bubble


def plot_schedule(rows: dict[int, list[dict[str, Any]]], path: str, *, schedule: str,
                  micro_batches: int, virtual_stages: int = 1, step: int = 0) -> bool:
    """Draw ``rows`` (:func:`schedule_from_trace`'s) into the PNG ``path``: a row per stage,
    each block where and as long as it ran, coloured by kind (F, B, W, BW), labelled with
    its micro-batch (and chunk); False (nothing drawn) without matplotlib or blocks. Not
    collective."""
    if not rows:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        log.warning("matplotlib is not installed; no schedule plot (pip install mpidist[plot])")
        return False
    t0 = min(b["ts"] for r in rows.values() for b in r)
    measured, predicted = _bubbles(rows, schedule, micro_batches, virtual_stages)
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.6 * len(rows)))
    for stage, blocks in rows.items():
        for b in blocks:
            x, w = (b["ts"] - t0) / 1e3, b["dur"] / 1e3
            ax.broken_barh([(x, w)], (stage - 0.4, 0.8), facecolors=_COLOURS[b["kind"]],
                           edgecolor="white", linewidth=0.5)
            label = f"{b['micro_batch']}" + (f".{b['chunk']}" if virtual_stages > 1 else "")
            ax.text(x + w / 2, stage, label, ha="center", va="center", fontsize=7,
                    color="white", clip_on=True)
    ax.set_yticks(list(rows), [f"stage {s}" for s in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's first block")
    pred = "" if predicted is None else f", simulated from these block times {predicted:.0%}"
    ax.set_title(f"{schedule}, {len(rows)} stages x {micro_batches} micro-batches"
                 + (f" x {virtual_stages} chunks" if virtual_stages > 1 else "")
                 + f", step {step}: bubble {measured:.0%}{pred}", fontsize=9)
    kinds = [k for k in _COLOURS if any(b["kind"] == k for r in rows.values() for b in r)]
    ax.legend(handles=[Patch(color=_COLOURS[k], label=k) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
