"""``mpidist train --strategy elastic``: the main job with workers leaving and joining.

:func:`run_elastic_training` is what :func:`mpidist.train.run_training` runs for
``--strategy elastic``. It trains the same GPT on the same data as the other strategies
(DDP, or ZeRO-1/2 with ``--zero-stage``), through an
:class:`~mpidist.parallel.elastic.ElasticOptimizer` bounded by ``--min-workers`` and
``--max-workers``. At every step boundary:

* a worker that received SIGTERM leaves (its shards move to the others; it exits 0);
* if the file ``<out>/elastic-target`` exists, rank 0 reads a world size from it, deletes
  it, and asks for that size: ``echo 4 > runs/train/elastic-target`` grows the job to 4
  workers by spawning (or shrinks it: the highest ranks leave);
* changes outside the bounds are refused (logged, an ``events.jsonl`` row) and training
  goes on.

Spawned workers run the same command line and join inside ``wrap``. Under the supervisor
(``mpidist run --elastic``), ``MPIDIST_RESTART`` > 0 implies ``--resume``, and
``MPIDIST_MIN_WORKERS``/``MPIDIST_MAX_WORKERS`` are the bounds when the config leaves them
at their defaults.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import numpy as np

__all__ = ["TARGET_FILE", "run_elastic_training"]

log = logging.getLogger("mpidist.train")

TARGET_FILE = "elastic-target"


class _RootLines:
    """Append JSON rows to a file from whichever process is rank 0 now."""

    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, is_root: bool, **row: Any) -> None:
        if is_root:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")


def _bounds(cfg: Any) -> tuple[int, int]:
    lo, hi = cfg.min_workers, cfg.max_workers
    if lo == 1 and "MPIDIST_MIN_WORKERS" in os.environ:
        lo = int(os.environ["MPIDIST_MIN_WORKERS"])
    if hi == 1024 and "MPIDIST_MAX_WORKERS" in os.environ:
        hi = int(os.environ["MPIDIST_MAX_WORKERS"])
    return lo, hi


def _read_target(out: str) -> int:
    path = os.path.join(out, TARGET_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
        os.remove(path)
    except FileNotFoundError:
        return 0
    try:
        return max(0, int(text))
    except ValueError:
        log.warning("%s: %r is not a number of workers; ignored", path, text)
        return 0


def run_elastic_training(cfg: Any, comm: Any = None) -> dict[str, Any]:
    """Run ``cfg`` (a :class:`mpidist.train.TrainConfig` with strategy "elastic").

    Collective over ``comm`` (default COMM_WORLD) at the start, then over the current
    workers. Returns the summary (on a worker that left: ``{"left": True, ...}``).
    """
    from mpi4py import MPI

    from mpidist.data import GlobalBatchSampler, TextCorpus
    from mpidist.launch.log import setup_logging
    from mpidist.nn import GPT, CrossEntropyLoss, GPTConfig
    from mpidist.optim import WarmupCosineSchedule
    from mpidist.parallel import ShardingConfiguration
    from mpidist.parallel.elastic import ElasticOptimizer
    from mpidist.train import _jsonable, _make_optimizer, _plot, _save

    joiner = ElasticOptimizer.is_joiner()
    comm = MPI.COMM_WORLD if comm is None else comm
    setup_logging(1 if joiner else comm.Get_rank())  # a joiner is never rank 0
    if cfg.pp != 1 or cfg.tp != 1:
        raise ValueError(f"--strategy elastic is data-parallel; got --pp {cfg.pp} --tp {cfg.tp}")
    lo, hi = _bounds(cfg)
    inner = f"zero{cfg.zero_stage}" if cfg.zero_stage else "ddp"
    schedule = WarmupCosineSchedule(cfg.lr, total_steps=max(1, cfg.steps),
                                    warmup_steps=min(cfg.warmup_steps, max(1, cfg.steps)),
                                    min_lr=min(cfg.min_lr, cfg.lr))
    config = ShardingConfiguration(dtype=cfg.dtype, micro_batches=cfg.micro_batches,
                                   max_grad_norm=cfg.max_grad_norm, bucket_mb=cfg.bucket_mb)
    events_path = os.path.join(cfg.out, "events.jsonl")
    opt = ElasticOptimizer(_make_optimizer(cfg), config, lo, hi, strategy=inner, comm=comm,
                           loss=CrossEntropyLoss(), lr_schedule=schedule, events=events_path)
    if not joiner and comm.Get_rank() == 0:
        os.makedirs(cfg.out, exist_ok=True)
    if not joiner:
        comm.Barrier()
    gpt_cfg = GPTConfig(vocab_size=cfg.vocab_size, block_size=cfg.block_size,
                        n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd)
    model = opt.wrap(GPT(gpt_cfg), seed=cfg.seed)
    train_data = TextCorpus(cfg.block_size, split="train")
    val_data = TextCorpus(cfg.block_size, split="validation")
    opt.sampler = GlobalBatchSampler(len(train_data), cfg.global_batch, seed=cfg.seed)
    events = _RootLines(events_path)
    metrics = _RootLines(os.path.join(cfg.out, "metrics.jsonl"))
    restart = int(os.environ.get("MPIDIST_RESTART", "0") or 0)
    if (cfg.resume or restart > 0) and not joiner:
        from mpidist.checkpoint.training import load_training, resolve_resume

        path = resolve_resume(cfg.out)
        if path is not None:
            load_training(path, opt, comm=opt.comm)
            events.write(opt.comm.Get_rank() == 0, event="resume", step=opt.step_count,
                         world_size=opt.current_workers, restart=restart,
                         checkpoint=os.path.basename(path), time=time.time())
    if not joiner:
        events.write(opt.comm.Get_rank() == 0, event="start", step=opt.step_count,
                     world_size=opt.current_workers, strategy="elastic", inner=inner,
                     min_workers=lo, max_workers=hi, config=_jsonable(cfg), time=time.time())
    tokens_per_step = cfg.global_batch * cfg.block_size
    loss = val_loss = float("nan")
    t_train = time.perf_counter()
    steps_done = 0
    while opt.step_count < cfg.steps:
        rank = opt.comm.Get_rank()
        if cfg.global_batch % (model.dp_size * cfg.micro_batches):
            raise ValueError(f"--global-batch {cfg.global_batch} does not divide into "
                             f"{model.dp_size} workers x {cfg.micro_batches} micro-batches")
        t0 = time.perf_counter()
        x, y = train_data.batch(opt.sampler.next_local(model.dp_rank, model.dp_size))
        loss = opt.step(model, (x, y))
        dt = time.perf_counter() - t0
        s = opt.step_count
        steps_done += 1
        metrics.write(rank == 0, step=s, loss=loss, split="train", lr=schedule(s - 1),
                      seconds=dt, tokens_per_s=tokens_per_step / dt,
                      workers=opt.current_workers)
        if rank == 0 and cfg.progress and (s % max(1, cfg.steps // 20) == 0 or s == cfg.steps):
            print(f"step {s}/{cfg.steps}  loss {loss:.4f}  workers {opt.current_workers}",
                  flush=True)
        if not np.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {s}; lower --lr")
        if cfg.eval_interval and (s % cfg.eval_interval == 0 or s == cfg.steps):
            val_loss = opt.evaluate(model, val_data, batches=cfg.eval_batches,
                                    global_batch_size=cfg.global_batch, seed=1234)
            metrics.write(rank == 0, step=s, loss=val_loss, split="validation")
        if cfg.checkpoint_interval and s % cfg.checkpoint_interval == 0 or s == cfg.steps:
            _save(cfg, opt, opt.comm, s, _Events(events, rank == 0))
        if s < cfg.steps:
            if rank == 0:
                target = _read_target(cfg.out)
                if target:
                    opt.scale_to(target)
            model = opt.maybe_rescale(model)
            if model is None:
                return {"left": True, "step": s, "steps_this_run": steps_done}
    seconds = time.perf_counter() - t_train
    rank = opt.comm.Get_rank()
    if model is not None and (not np.isfinite(val_loss) or cfg.eval_interval == 0):
        val_loss = opt.evaluate(model, val_data, batches=cfg.eval_batches,
                                global_batch_size=cfg.global_batch, seed=1234)
        metrics.write(rank == 0, step=cfg.steps, loss=val_loss, split="validation")
    baseline = train_data.unigram_baseline()
    summary = {"strategy": "elastic", "inner_strategy": inner,
               "world_size": opt.current_workers,
               "mesh": {"pp": 1, "dp": opt.current_workers, "tp": 1},
               "unigram_baseline": baseline, "steps": cfg.steps,
               "steps_this_run": steps_done, "final_train_loss": loss,
               "final_validation_loss": val_loss, "seconds": seconds,
               "changes": [h for h in opt.history if h["event"] != "refused"]}
    events.write(rank == 0, event="end", step=opt.step_count, world_size=opt.current_workers,
                 final_loss=loss, validation_loss=val_loss, time=time.time())
    if rank == 0:
        with open(os.path.join(cfg.out, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
        _plot(os.path.join(cfg.out, "metrics.jsonl"), os.path.join(cfg.out, "loss.png"),
              baseline)
        print(f"mpidist train (elastic, {inner}): {cfg.steps} steps, final loss {loss:.4f}, "
              f"validation {val_loss:.4f} (unigram baseline {baseline:.4f}), "
              f"{opt.current_workers} workers at the end; outputs in {cfg.out}/", flush=True)
    opt.comm.Barrier()
    opt.free()
    return summary


class _Events:
    """The ``write(**row)`` interface that :func:`mpidist.train._save` expects."""

    def __init__(self, lines: _RootLines, is_root: bool) -> None:
        self.lines, self.is_root = lines, is_root

    def write(self, **row: Any) -> None:
        self.lines.write(self.is_root, **row)
