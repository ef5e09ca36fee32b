"""What a run writes and shows: JSON-lines files, the progress bar, the loss plot, the
summary. Only the process that is rank 0 now writes (in an elastic job that may change)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import Any

__all__ = ["JsonLines", "Progress", "plot_losses", "print_summary", "write_summary"]

log = logging.getLogger("mpidist.cli.train")


class JsonLines:
    """Append JSON objects to a file, one per line, from rank 0 only.

    ``is_root`` is a callable, asked at every write, so that rank 0 of a resized elastic
    job is the one that writes.
    """

    def __init__(self, path: str, is_root: Any) -> None:
        self.path = path
        self.is_root = is_root

    def write(self, **row: Any) -> None:
        """Append ``row`` (rank 0 only). Not collective."""
        if self.is_root():
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")


class Progress:
    """tqdm on rank 0 when available and wanted; otherwise a line every few steps."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self.bar = None
        self.enabled = enabled
        self.total = total
        self.note = ""  # shown after the loss (a straggler named, ...)
        if enabled:
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                                file=sys.stderr, mininterval=0.5)

    def update(self, step: int, loss: float, tok_s: float, workers: int | None = None) -> None:
        """Advance by one step. Not collective."""
        if not self.enabled:
            return
        extra: dict[str, Any] = {} if workers is None else {"workers": workers}
        if self.note:
            extra["note"] = self.note
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", **extra,
                                 refresh=False)
            self.bar.update(1)
        elif step % max(1, self.total // 20) == 0 or step == self.total:
            more = ("" if workers is None else f"  workers {workers}") \
                + (f"  {self.note}" if self.note else "")
            print(f"step {step}/{self.total}  loss {loss:.4f}  {tok_s:,.0f} tok/s{more}",
                  flush=True)

    def rewind(self, step: int) -> None:
        """Go back to ``step`` (steps after it are redone). Not collective."""
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def close(self) -> None:
        """Close the bar. Not collective."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def plot_losses(metrics_path: str, out_png: str, baseline: float) -> bool:
    """Plot train and validation losses of ``metrics.jsonl``; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; no loss plot (pip install mpidist[plot])")
        return False
    train, val = [], []
    with open(metrics_path) as f:
        for line in f:
            row = json.loads(line)
            (val if row.get("split") == "validation" else train).append((row["step"], row["loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train", lw=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation")
    ax.axhline(baseline, color="gray", ls="--", label=f"unigram baseline {baseline:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("mpidist train")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return True


def write_summary(summary: dict[str, Any], out: str) -> None:
    """``summary.json``, the loss plot and the printed summary (call on rank 0).

    A preempted run skips the plot: it would spend seconds of the time Slurm leaves before
    SIGKILL, and the run's next start draws it."""
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    plotted = False
    if not summary.get("preempted"):
        plotted = plot_losses(os.path.join(out, "metrics.jsonl"),
                              os.path.join(out, "loss.png"), summary["unigram_baseline"])
    print_summary(summary, out, plotted)


def print_summary(s: dict[str, Any], out: str, plotted: bool) -> None:
    """The human-readable end of a run."""
    mb = 2**20
    print("\n== mpidist train summary ==")
    print(f"strategy {s['strategy']} on {s['world_size']} rank(s), mesh {s['mesh']}")
    if s.get("preempted"):
        print(f"preempted by {s['preempted']} after step {s['steps_done']}: checkpoint "
              "written; run again with --resume to continue")
    print(f"final train loss      {s['final_train_loss']:.4f}")
    print(f"final validation loss {s['final_validation_loss']:.4f}   "
          f"(unigram baseline of the corpus: {s['unigram_baseline']:.4f} nats/token)")
    if s.get("final_validation_bits_per_byte") is not None:
        print(f"validation bits/byte  {s['final_validation_bits_per_byte']:.4f}   (the loss per "
              "byte of text: comparable across tokenizers)")
    if s["final_validation_loss"] == s["final_validation_loss"]:  # not NaN (preempted runs)
        verdict = "below" if s["final_validation_loss"] < s["unigram_baseline"] else "NOT below"
        print(f"validation loss is {verdict} the unigram baseline")
    print(f"throughput            {s['tokens_per_second']:,.0f} tokens/s over "
          f"{s['steps_this_run']} steps in {s['seconds']:.1f} s")
    t = s["time_split_seconds"]
    total = sum(t.values()) or 1.0
    print("time split            " + ", ".join(
        f"{k} {v:.1f} s ({100 * v / total:.0f}%)" for k, v in t.items()))
    background = (s.get("io_seconds") or {}).get("background", 0.0)
    if background:
        print(f"checkpoint io         {t['io']:.1f} s blocking (in the split above), "
              f"{background:.1f} s written in the background alongside training")
    copies = any(m.get("redundancy", 0) for m in s["memory_bytes_per_rank"])
    print("memory per rank (MiB): rank  params  grads  optimizer  working-peak  snapshot"
          + ("  copies" if copies else ""))
    for r, m in enumerate(s["memory_bytes_per_rank"]):
        print(f"{'':22}{r:>4}  {m['parameters'] / mb:6.2f} {m['gradients'] / mb:6.2f}"
              f"  {m['optimizer_state'] / mb:9.2f}  {m['working_peak'] / mb:12.2f}"
              f"  {m.get('host_snapshot', 0) / mb:8.2f}"
              + (f"  {m.get('redundancy', 0) / mb:6.2f}" if copies else ""))
    for rec in s.get("recoveries") or []:
        redo = "" if rec.get("redo_s") is None else f", redo {rec['redo_s']:.2f} s"
        print(f"recovered in-job      lost rank(s) {rec['lost']} after step {rec['step']}: "
              f"{rec['world_size']} rank(s) went on (detect {rec['detect_s']:.3f} s, shrink "
              f"{rec['shrink_s']:.3f} s, rebuild {rec['rebuild_s']:.3f} s{redo})")
    for g in s.get("grown") or []:
        print(f"grown back            after step {g['step']}: {g['from']} -> {g['to']} rank(s) "
              f"(the join stalled training {g['stall_s']:.3f} s, spawn {g['spawn_s']:.3f} s)")
    from mpidist.run.stragglers import rank_table_lines

    for line in rank_table_lines(s):
        print(line)
    print(f"outputs in {out}/: metrics.jsonl, events.jsonl, summary.json, checkpoints"
          + (", loss.png" if plotted else ""), flush=True)
