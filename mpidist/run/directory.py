"""The run directory (``--out``): what it holds (:func:`inspect_out`, which rank 0 calls
and broadcasts), the rows of an abandoned attempt dropped after a resume
(:func:`drop_rows_after`), and ``--overwrite`` (:func:`remove_run_outputs`).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

__all__ = ["HANG_DIR", "JSONL_FILES", "LOG_NAME", "RUN_OUTPUTS", "drop_rows_after", "inspect_out",
           "remove_run_outputs"]

#: The run's log: rank 0's messages and the traceback of a failing rank.
LOG_NAME = "train.log"
#: Files a run writes next to its checkpoints.
RUN_OUTPUTS = ("metrics.jsonl", "events.jsonl", "summary.json", "loss.png", LOG_NAME,
               "trace.json", "schedule.png")
#: Where the flight recorder of every rank dumps (``mpidist doctor OUT`` reads it).
HANG_DIR = "hang"
#: The files that get one row per step or event.
JSONL_FILES = ("metrics.jsonl", "events.jsonl")


def inspect_out(out: str) -> dict[str, Any]:
    """What ``out`` holds, as JSON: ``exists``, ``checkpoints`` (names), ``latest`` (path or
    None), and of the latest checkpoint ``step``, ``world_size``, ``dtype``,
    ``optimizer`` (name), ``train_config`` (the settings ``mpidist train`` stored, or
    None), ``data_hash`` (the content hash of the data it was trained on, or None) and
    ``data`` (its record, without the tokenizer: kind, hash, a blend's sources);
    ``outputs``: the run output files present and not empty; ``error``: why the
    latest checkpoint cannot be read (or ""). Not collective (rank 0 calls it)."""
    from mpidist.checkpoint import (
        CheckpointError,
        latest_checkpoint,
        list_checkpoints,
        read_metadata,
    )

    state: dict[str, Any] = {"exists": os.path.isdir(out), "checkpoints": [], "latest": None,
                             "step": None, "world_size": None, "dtype": None,
                             "optimizer": None, "train_config": None, "data_hash": None,
                             "data": None, "outputs": [], "error": ""}
    if not state["exists"]:
        return state
    state["checkpoints"] = [os.path.basename(p) for p in list_checkpoints(out)]
    state["outputs"] = [n for n in RUN_OUTPUTS if _non_empty(os.path.join(out, n))]
    latest = latest_checkpoint(out)
    if latest is None:
        return state
    state["latest"] = os.path.join(out, os.path.basename(latest))
    try:
        attrs, _ = read_metadata(latest)
    except CheckpointError as exc:
        state["error"] = str(exc)
        return state
    extra = attrs.get("extra") or {}
    config = extra.get("train_config") if isinstance(extra, dict) else None
    data = extra.get("data") if isinstance(extra, dict) else None
    state["data_hash"] = data.get("hash") if isinstance(data, dict) else None
    state["data"] = {k: v for k, v in data.items() if k != "tokenizer"} \
        if isinstance(data, dict) else None
    # The training step (fp16's skipped updates leave the optimizer's count behind).
    state.update(step=int(attrs.get("steps_taken", attrs.get("step", 0))),
                 world_size=attrs.get("world_size"), dtype=attrs.get("dtype"),
                 optimizer=(attrs.get("optimizer") or {}).get("name"),
                 train_config=config if isinstance(config, dict) else None)
    return state


def _non_empty(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


def drop_rows_after(path: str, step: int) -> int:
    """Remove the rows with ``step`` > ``step`` (and unreadable lines) from a JSON-lines
    file, atomically; the number removed. The file is left untouched when none is.

    Not collective (rank 0 calls it)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return 0
    keep = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the torn last line of a killed run
        s = row.get("step") if isinstance(row, dict) else None
        if isinstance(s, (int, float)) and s > step:
            continue
        keep.append(line)
    dropped = len(lines) - len(keep)
    if dropped:
        from mpidist.checkpoint.paths import write_atomic

        write_atomic(path, "".join(line + "\n" for line in keep))
    return dropped


def remove_run_outputs(out: str) -> list[str]:
    """Delete the checkpoints, the ``latest`` pointer, the run outputs and the
    flight-recorder dumps of ``out`` (``--overwrite``); the names removed. Not collective
    (rank 0 calls it)."""
    from mpidist.checkpoint import LATEST, list_checkpoints

    names = [os.path.basename(p) for p in list_checkpoints(out)]
    names += [n for n in (LATEST, *RUN_OUTPUTS) if os.path.exists(os.path.join(out, n))]
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, name))
    hang = os.path.join(out, HANG_DIR)  # an earlier run's flight-recorder dumps
    if os.path.isdir(hang):
        for name in os.listdir(hang):
            if name.startswith(("rank-", "spawned-")):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(hang, name))
        with contextlib.suppress(OSError):
            os.rmdir(hang)
            names.append(HANG_DIR + "/")
    return names
