"""What a run does with its ``--out``: start, resume, refuse, or find nothing to do.

Pure functions of the settings, the flags the user gave and what rank 0 found in the
directory (:func:`mpidist.run.directory.inspect_out`), so every rank decides the same. On
``--resume`` the settings come from the checkpoint by group: :data:`FIXED` (a contradicting
flag is an error), :data:`TUNABLE` (a value given that differs is used, and said),
:data:`LAYOUT` (restored unless ``--strategy`` is given; ``--dp`` only on the checkpoint's
world size) and :data:`CADENCE` (restored unless given). See ``docs/runs.md``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from mpidist.run.config import TrainConfig

__all__ = ["BY_HASH", "CADENCE", "FIXED", "LAYOUT", "TUNABLE", "NothingToDo",
           "check_data_hash", "decide_start", "flag", "resolve_settings"]

FIXED = ("dtype", "n_layer", "n_head", "n_embd", "block_size", "vocab_size", "optimizer",
         "global_batch", "seed", "data", "data_blend")
#: Settings restored from the checkpoint but not compared as values: the data is compared by
#: its content hash once it is open (the same data may have moved).
BY_HASH = ("data", "data_blend")
#: Settings of which one names the data: giving either restores neither.
DATA = ("data", "data_blend")
TUNABLE = ("lr", "min_lr", "warmup_steps", "lr_decay_steps", "weight_decay",
           "max_grad_norm", "precision")
LAYOUT = ("strategy", "pp", "tp", "dp", "zero_stage", "schedule", "virtual_stages",
          "recompute", "micro_batches", "sync_period", "shard_group", "compression",
          "topk_ratio", "powersgd_rank", "staleness", "bucket_mb", "min_workers",
          "max_workers")
CADENCE = ("steps", "checkpoint_interval", "keep", "eval_interval", "eval_batches",
           "data_binary", "val_data", "val_bytes", "data_verify")


class NothingToDo(Exception):  # noqa: N818 - not an error: the run is already there
    """The checkpoint is at or past ``--steps``; the message says so."""


def flag(name: str, value: Any) -> str:
    """``--n-embd 32`` for ``("n_embd", 32)``."""
    if value is None:
        value = "none"
    return f"--{name.replace('_', '-')} {value}"


def _same(name: str, a: Any, b: Any) -> bool:
    if name in BY_HASH:
        return True
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) \
            and not isinstance(a, bool) and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


def decide_start(cfg: TrainConfig, state: dict[str, Any], restart: bool) -> str:
    """``"resume"`` or ``"start"``, or a ValueError saying why neither.

    ``restart``: a supervisor's restart or a requeued Slurm start, which resume when there
    is a checkpoint whatever the flags say (``--overwrite`` applies to the first start).
    """
    out = cfg.out
    if state.get("error"):
        raise ValueError(f"--out {out}: the latest checkpoint cannot be read: {state['error']}")
    has = state.get("latest") is not None
    if restart or cfg.resume == "auto":
        if cfg.overwrite and not restart:
            raise ValueError("--overwrite and --resume auto contradict each other")
        return "resume" if has else "start"
    if cfg.resume:
        if cfg.overwrite:
            raise ValueError("--overwrite and --resume contradict each other")
        if not has:
            where = "does not exist" if not state.get("exists") else "holds no checkpoint"
            raise ValueError(f"--resume: --out {out} {where}; give the directory of the run "
                             "to continue, or --resume auto to start when there is none")
        return "resume"
    ckpts = list(state.get("checkpoints") or [])
    if ckpts or has:
        n = max(len(ckpts), 1)
        what = f"{n} checkpoint{'s' if n > 1 else ''} of a run (latest " \
               f"{os.path.basename(state['latest'] or ckpts[-1])}" + \
               (f", step {state['step']})" if state.get("step") is not None else ")")
    elif "metrics.jsonl" in (state.get("outputs") or ()):
        if cfg.overwrite:
            return "start"
        raise ValueError(f"--out {out} holds the metrics.jsonl of a run that wrote no "
                         "checkpoint; start over with --overwrite (deletes that run's files)")
    else:
        return "start"
    if not cfg.overwrite:
        raise ValueError(f"--out {out} holds {what}; continue it with --resume, or start "
                         "over with --overwrite (deletes that run's files)")
    return "start"


def resolve_settings(cfg: TrainConfig, given: set[str], state: dict[str, Any],
                     world_size: int) -> tuple[TrainConfig, list[str]]:
    """The settings of a run resumed from ``state``'s checkpoint, and notes to print.

    ``given``: the settings the user set (flags and TOML keys). Raises ValueError (one
    line) when a fixed setting contradicts the checkpoint, :class:`NothingToDo` when the
    checkpoint is at or past ``--steps``.
    """
    path = state["latest"]
    stored = dict(state.get("train_config") or {})
    if not stored:  # not written by `mpidist train`: what the attributes say
        stored = {k: v for k, v in (("dtype", state.get("dtype")),
                                    ("optimizer", state.get("optimizer"))) if v is not None}
    if stored.get("lr_decay_steps") is None and "steps" in stored:
        stored["lr_decay_steps"] = stored["steps"]  # checkpoints from before the setting
    clash = [k for k in FIXED if k in stored and k in given
             and not _same(k, getattr(cfg, k), stored[k])]
    if clash:
        raise ValueError(
            f"checkpoint {path} was trained with "
            f"{' '.join(flag(k, stored[k]) for k in clash)}; this run asks for "
            f"{' '.join(flag(k, getattr(cfg, k)) for k in clash)}")
    restore = [k for k in (*FIXED, *TUNABLE, *CADENCE) if k in stored and k not in given
               and not (k in DATA and given & set(DATA))]
    if "strategy" not in given:
        same_size = state.get("world_size") == world_size
        # The chunks per stage belong to the schedule: a new --schedule brings its own.
        restore += [k for k in LAYOUT if k in stored and k not in given
                    and (k != "dp" or same_size)
                    and (k != "virtual_stages" or "schedule" not in given)]
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: stored[k] for k in restore if k in known}
    notes = [f"{flag(k, getattr(cfg, k))} (the checkpoint was trained with "
             f"{flag(k, stored[k])})" for k in TUNABLE
             if k in given and k in stored and not _same(k, getattr(cfg, k), stored[k])]
    try:
        new = dataclasses.replace(cfg, **values)
    except ValueError as exc:
        if values.get("data") is None:
            raise
        raise ValueError(f"{exc} (the data checkpoint {path} was trained on; give --data "
                         "where it is now)") from None
    step = int(state.get("step") or 0)
    if new.steps <= step:
        raise NothingToDo(
            f"{os.path.basename(path)} in {cfg.out} is at step {step} and --steps is "
            f"{new.steps}: nothing to do (give a larger --steps to train further)")
    return new, notes


def _blend_words(record: dict[str, Any]) -> str:
    return " ".join(f"{s['share']:.4g} {os.path.basename(str(s['path']))}"
                    for s in record.get("sources") or ())


def check_data_hash(stored: str | None, identity: dict[str, Any], data: str | None,
                    checkpoint: str, *, record: dict[str, Any] | None = None,
                    reweight: bool = False) -> str | None:
    """Raise ValueError when the data of a resumed run is not the data its checkpoint was
    trained on: their content hashes differ (``stored`` None: a checkpoint from before the
    hashes were recorded; nothing to compare). A blend's hash covers its sources' content
    hashes and weights. ``record``: the checkpoint's data record (names a blend's sources
    in the message). ``reweight`` (``--data-reweight``): token data that changed is
    accepted; the note to print is returned. Pure."""
    found = identity.get("hash")
    if stored is None or found is None or stored == found:
        return None
    was_blend = (record or {}).get("kind") == "blend"
    now_blend = identity.get("kind") == "blend"
    before = f"the blend {_blend_words(record or {})}" if was_blend else f"data with hash {stored}"
    if reweight and identity.get("kind") != "text" and (record or {}).get("kind") != "text":
        now = f"the blend {_blend_words(identity)}" if now_blend else f"--data {data}"
        return (f"--data-reweight: {now} instead of {before}; the position (step) "
                "continues, the proportions change")
    if now_blend or was_blend:
        now = f"--data-blend {_blend_words(identity)}" if now_blend else f"--data {data}"
        raise ValueError(f"{now} is not the data checkpoint {checkpoint} was trained on "
                         f"({before}; weights normalized, sources compared by content "
                         "hash): give the same blend, or --data-reweight to continue with "
                         "the new proportions")
    what = f"--data {data}" if data else "the embedded corpus"
    raise ValueError(f"{what} has content hash {found}, but checkpoint {checkpoint} was "
                     f"trained on data with hash {stored}: give the data it was trained on "
                     "(moved or renamed is fine)")
