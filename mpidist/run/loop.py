"""``run_training``: the one training loop of ``mpidist train``, for every strategy.

The steps themselves go through :func:`mpidist.parallel.loop.run_steps`; everything a run
does around them is a hook here: metrics and the progress bar, validation, checkpoints,
preemption (:mod:`mpidist.run.preempt`) and elastic resizing (:mod:`mpidist.run.elastic`).

Outputs under ``--out``: ``metrics.jsonl`` (one JSON object per step with ``step`` and
``loss``, and validation rows), ``events.jsonl`` (start, resume, checkpoint, preempted,
elastic changes, end), checkpoints ``ckpt-<step>.h5`` with a ``latest`` pointer,
``loss.png`` and ``summary.json``; ``hang/`` holds each rank's flight-recorder dump when
the job hangs (``--hang-timeout``), on SIGUSR2, or when it is aborted (``mpidist doctor
OUT`` reads them; :mod:`mpidist.core.recorder`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections.abc import Collection
from typing import Any

import numpy as np

from mpidist.core import collectives as C
from mpidist.core import recorder
from mpidist.core.comms import phase, world
from mpidist.core.failure import ProcessFailure
from mpidist.nn.allocator import reuse_freed_memory
from mpidist.parallel.loop import recover_in_loop, run_steps
from mpidist.parallel.regrow import is_newcomer
from mpidist.run.build import make_data, make_model, make_strategy
from mpidist.run.checkpoints import RunCheckpoints
from mpidist.run.config import TrainConfig, check_output_directory
from mpidist.run.directory import (
    HANG_DIR,
    JSONL_FILES,
    LOG_NAME,
    drop_rows_after,
    remove_run_outputs,
)
from mpidist.run.elastic import ElasticHook, check_global_batch
from mpidist.run.lock import RunLock
from mpidist.run.logs import set_run_log, setup_logging
from mpidist.run.opening import HOLDER, RunOpening, open_run, restart_count
from mpidist.run.outputs import JsonLines, Progress, write_summary
from mpidist.run.preempt import (
    EXIT_PREEMPTED,
    PREEMPT_SIGNALS,
    Preemption,
    StepAgreement,
    requeue_slurm_job,
    signal_name,
)
from mpidist.run.recovery import RunRecovery
from mpidist.run.regrow import RunRegrow
from mpidist.run.resume import check_data_hash
from mpidist.run.timeline import RunTimeline

__all__ = ["EXIT_PREEMPTED", "run_training"]

log = logging.getLogger("mpidist.cli.train")

_MEM_KEYS = ("parameters", "gradients", "optimizer_state", "working_peak", "host_snapshot",
             "redundancy")
_EVAL_SEED = 1234


def run_training(cfg: TrainConfig, comm: Any = None, *,
                 given: Collection[str] | None = None) -> dict[str, Any]:
    """Run a training job. Collective over ``comm`` (default COMM_WORLD); returns the summary.

    Every rank validates the configuration identically before any communication, so bad
    settings raise the same ValueError everywhere. Rank 0 then holds ``cfg.out``'s lock
    for the run's life (:mod:`mpidist.run.lock`). ``given``: the settings the user set
    (default: all of them); on resume the others come from the checkpoint
    (:mod:`mpidist.run.resume`). A run with nothing to do (the checkpoint is at
    ``--steps``) changes no file and returns ``{"nothing_to_do": True, ...}``. A preempted
    run (SIGTERM or SIGUSR1) returns after its checkpoint with ``summary["preempted"]`` set
    to the signal's name; a worker that left an elastic job returns ``{"left": True, ...}``.
    Freed step memory is kept for reuse (:func:`mpidist.nn.allocator.reuse_freed_memory`).
    """
    reuse_freed_memory()
    comm = world(comm)
    joiner = False
    if cfg.strategy == "elastic":
        from mpidist.parallel import ElasticOptimizer

        joiner = ElasticOptimizer.is_joiner()
    else:  # spawned to grow the job back after a lost rank (mpidist.run.regrow)
        joiner = is_newcomer()
    rank = 1 if joiner else comm.Get_rank()  # a joiner is never rank 0
    setup_logging(rank)
    check_output_directory(cfg.out)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    opening = open_run(cfg, comm, names if given is None else set(given), joiner=joiner)
    if opening.mode == "nothing":
        if rank == 0:
            print(f"mpidist train: {opening.message}", flush=True)
        return {"nothing_to_do": True, "step": opening.state.get("step"),
                "steps": opening.cfg.steps}
    run = None
    failed = True
    # the flight recorder dumps into OUT/hang (mpidist doctor OUT) while the run lasts, and
    # after a failure (the abort path dumps too)
    before = recorder.install(directory=os.path.join(cfg.out, HANG_DIR),
                              timeout=cfg.hang_timeout, abort=cfg.hang_abort or None)
    try:
        if not joiner:
            set_run_log(os.path.join(cfg.out, LOG_NAME), rank)
        recorder.introduce(comm)
        run = _Run(opening, comm, joiner)
        summary = run.execute()
        failed = False
        recorder.install(**before)
        return summary
    finally:
        if run is not None:
            run.timeline.close()
            close = getattr(run.opt, "close", None)  # the elastic optimizer's SIGTERM handler
            if close is not None:
                close()
            run.preemption.restore()
            if run.left and opening.lock is not None:
                opening.lock.abandon()  # the new rank 0 holds it now
                opening.lock = None
        opening.close(failed=failed)


class _Run:
    """One run's objects and hooks; :meth:`execute` is the whole run."""

    def __init__(self, opening: RunOpening, comm: Any, joiner: bool) -> None:
        self.opening = opening
        self.cfg = cfg = opening.cfg
        self.comm = comm
        self.elastic = cfg.strategy == "elastic"
        self.joiner = joiner
        self.newcomer = joiner and not self.elastic  # spawned to grow back after a loss
        self.left = False
        # Elastic jobs keep SIGTERM for "this worker leaves"; SIGUSR1 preempts them.
        signals = [s for s in PREEMPT_SIGNALS if not (self.elastic and s == signal.SIGTERM)]
        self.preemption = Preemption(signals)
        self.preemption.install()
        # One collective between steps decides, alike on every rank, all that must be.
        self.agreement = StepAgreement()
        self.opt = make_strategy(cfg, comm)
        self.recovery = RunRecovery(self)  # in-job recovery from a lost rank, where it can
        self.regrow = RunRegrow(self)  # and growing back to size afterwards
        self.io_seconds = 0.0
        self._skipped = 0
        self.last_saved = -1
        self.val_loss = float("nan")
        self.preempted = ""
        self.metrics = JsonLines(os.path.join(cfg.out, "metrics.jsonl"), self.is_root)
        self.events = JsonLines(os.path.join(cfg.out, "events.jsonl"), self.is_root)
        # per-rank times, straggler reports, speed, the trace window (--trace)
        self.timeline = RunTimeline(cfg, self)
        self.checkpoints = RunCheckpoints(cfg, self.events)

    # -- who is who --------------------------------------------------------------------------
    def job_comm(self) -> Any:
        """The communicator of every rank of the job now (elastic: the current workers)."""
        return self.opt.comm if self.elastic else self.comm

    def is_root(self) -> bool:
        comm = self.job_comm()
        return comm is not None and comm.Get_rank() == 0

    def world_size(self) -> int:
        return self.opt.current_workers if self.elastic else self.comm.Get_size()

    # -- the run -------------------------------------------------------------------------------
    def execute(self) -> dict[str, Any]:
        cfg = self.cfg
        t_setup = time.perf_counter()
        if self.newcomer:  # the model and the state come from the survivors
            self.model = self.regrow.join(make_model(cfg))
        else:
            self.model = self.opt.wrap(make_model(cfg), seed=cfg.seed)
        check_global_batch(cfg, self.model.dp_size)
        # Elastic workers join mid-run, when the others are not there to share the work.
        self.train_data, self.val_data = make_data(
            cfg, None if self.elastic or self.newcomer else self.comm)
        sampler = self.train_data.sampler(cfg.global_batch, seed=cfg.seed)
        sampler.reweight = cfg.data_reweight  # a changed blend continues at its step
        self.opt.sampler = sampler
        if self.newcomer:
            self.regrow.place_sampler(sampler)
        if self.opening.mode == "resume":
            note = check_data_hash(self.opening.state.get("data_hash"),
                                   self.train_data.identity(), cfg.data,
                                   os.path.basename(self.opening.state["latest"]),
                                   record=self.opening.state.get("data"),
                                   reweight=cfg.data_reweight)
            if note and self.is_root():
                print(f"mpidist train: {note}", flush=True)
        if not self.joiner:
            start = self._maybe_resume()
            self._start(start)
        self.progress = Progress(cfg.steps, self.opt.step_count,
                                 enabled=self.is_root() and cfg.progress)
        self.timeline.begin(self.model, self.job_comm(), self.opt.step_count,
                            joiner=self.joiner)
        # the step's times (and report) first; metrics etc. after each step, then
        # preemption; after a recovery, rank 0's duties move first, then the save in flight
        # is recorded as abandoned
        hooks: list[Any] = [self.timeline, self, self.recovery, self.checkpoints,
                            self.regrow]
        elastic = ElasticHook(self.opt, cfg) if self.elastic else None
        if elastic is not None:
            hooks += [elastic, _BetweenSteps(self._take_lock_over)]
        hooks.append(self.timeline.tail)  # the trace window opens and closes last
        t_train = time.perf_counter()
        done = 0
        while True:
            try:
                outcome = run_steps(self.opt, self.model, self.timeline.data(self.train_data),
                                    until=cfg.steps, sampler=self.opt.sampler, hooks=hooks)
            finally:
                self.progress.close()
            seconds = time.perf_counter() - t_train
            self.model = outcome.model if outcome.model is not None else self.opt.model
            outcome.steps += done
            if (elastic is not None and elastic.left) or outcome.released:
                self.left = True  # (released: no place in the survivors' mesh)
                return {"left": True, "step": self.opt.step_count,
                        "steps_this_run": outcome.steps}
            try:
                return self._finish(outcome, seconds, t_train - t_setup)
            except ProcessFailure as lost:  # in the final evaluation or the summary
                done = outcome.steps
                changed = recover_in_loop(self.opt, lost)
                if changed.released:
                    self.left = True
                    return {"left": True, "step": self.opt.step_count,
                            "steps_this_run": done}
                self.recovery.mesh_changed(changed.model, changed)
                self.checkpoints.mesh_changed(changed.model, changed)
                self.timeline.mesh_changed(changed.model, changed)

    def _maybe_resume(self) -> int:
        """Load the checkpoint the opening chose (or clear the way for a new run), then
        leave each step once in metrics.jsonl and events.jsonl. The step to start from."""
        cfg, opening = self.cfg, self.opening
        if opening.mode != "resume":
            if self.is_root():
                if cfg.overwrite:
                    removed = remove_run_outputs(cfg.out)
                    set_run_log(os.path.join(cfg.out, LOG_NAME), 0)  # a new file
                    if removed:
                        print(f"mpidist train: --overwrite: deleted {', '.join(removed)} "
                              f"in {cfg.out}", flush=True)
                else:
                    self._drop_rows_after(0)
            return 0
        from mpidist.checkpoint.training import load_training

        path = opening.state["latest"]
        t0 = time.perf_counter()
        with phase("checkpoint"):
            load_training(path, self.opt, comm=self.job_comm())
        self.io_seconds += time.perf_counter() - t0
        step = self.opt.step_count
        if self.is_root():
            self._drop_rows_after(step)
        restart = restart_count()
        self.events.write(event="resume", step=step, world_size=self.world_size(),
                          checkpoint=os.path.basename(path), time=time.time(),
                          **({"restart": restart} if restart else {}),
                          **self.recovery.start_fields(),
                          **self.regrow.start_fields())  # this attempt's first event
        if self.is_root():
            lr = self.opt.lr_schedule(step) if self.opt.lr_schedule is not None else cfg.lr
            print(f"mpidist train: resuming {path} at step {step} on {self.world_size()} "
                  f"rank(s); learning rate at step {step + 1}: {lr:.4g} (cosine to --min-lr "
                  f"{cfg.min_lr:g} at step {cfg.lr_decay_steps})", flush=True)
            for note in opening.notes:
                print(f"mpidist train: using {note}", flush=True)
        return step

    def _drop_rows_after(self, step: int) -> None:
        """Rank 0: remove the rows of an abandoned attempt past ``step``."""
        for name in JSONL_FILES:
            n = drop_rows_after(os.path.join(self.cfg.out, name), step)
            if n:
                log.info("%s: dropped %d row(s) past step %d of an abandoned attempt",
                         name, n, step)

    def _start(self, start: int) -> None:
        cfg = self.cfg
        extra: dict[str, Any] = {}
        if self.elastic:
            extra = {"inner": self.opt.inner_strategy, "min_workers": self.opt.min_workers,
                     "max_workers": self.opt.max_workers}
        self.events.write(event="start", step=start, world_size=self.world_size(),
                          strategy=cfg.strategy, mesh=_mesh_dict(self.model),
                          config=dataclasses.asdict(cfg), time=time.time(), **extra,
                          **self.recovery.start_fields(), **self.regrow.start_fields())
        if self.is_root():
            n_params = sum(int(np.prod(s)) for _, s in make_model(cfg).named_parameter_shapes())
            where = getattr(self.model, "device", None)
            on = "" if where is None or where.is_cpu else f" on {where}"
            mixed = "" if cfg.precision == "full" else f" ({cfg.precision})"
            print(f"mpidist train: {cfg.strategy} on {self.world_size()} rank(s) "
                  f"{_mesh_dict(self.model)}{on}, GPT {cfg.n_layer}x{cfg.n_embd} ({n_params:,} "
                  f"parameters), {cfg.dtype}{mixed}, global batch {cfg.global_batch} x "
                  f"{cfg.block_size} tokens, steps {start}->{cfg.steps}", flush=True)
            mesh = getattr(self.model, "mesh", None)
            if mesh is not None and hasattr(mesh, "node_banner"):
                print(mesh.node_banner(), end="", flush=True)  # the layout by node
        self.recovery.announce()
        self.regrow.announce()

    # -- hooks ---------------------------------------------------------------------------------
    def after_step(self, model: Any, rec: Any) -> None:
        """Metrics, progress, validation and periodic checkpoints (every rank)."""
        cfg = self.cfg
        lr = self.opt.lr_schedule(rec.step - 1) if self.opt.lr_schedule is not None else cfg.lr
        workers = {"workers": self.world_size()} if self.elastic else {}
        scaler = getattr(self.opt, "scaler", None)
        if scaler is not None:  # fp16: the loss scale, and the steps skipped on overflow
            workers.update(loss_scale=scaler.scale, skipped_steps=scaler.skipped)
            if scaler.skipped > self._skipped and self.is_root():
                print(f"step {rec.step}: fp16 gradients overflowed, update skipped; loss "
                      f"scale now {scaler.scale:g}", flush=True)
            self._skipped = scaler.skipped
        tok_s = rec.tokens / rec.seconds if rec.seconds > 0 else 0.0
        self.metrics.write(step=rec.step, loss=rec.loss, split="train", lr=lr,
                           seconds=rec.seconds, tokens_per_s=tok_s, **workers,
                           **self.timeline.fields)
        self.progress.update(rec.step, rec.loss, tok_s, workers.get("workers"))
        if not np.isfinite(rec.loss):
            raise FloatingPointError(f"loss became {rec.loss} at step {rec.step}; lower --lr")
        lock = self.opening.lock
        if lock is not None and lock.lost:
            raise RuntimeError(f"another run took over the lock of {cfg.out}: {lock.lost}")
        s = rec.step
        if cfg.eval_interval and (s % cfg.eval_interval == 0 or s == cfg.steps):
            self._evaluate(model, s)
        if cfg.checkpoint_interval and s % cfg.checkpoint_interval == 0 or s == cfg.steps:
            self._save(s, final=s == cfg.steps)

    def _evaluate(self, model: Any, step: int) -> None:
        cfg = self.cfg
        self.val_loss = self.opt.evaluate(model, self.val_data, batches=cfg.eval_batches,
                                          global_batch_size=cfg.global_batch, seed=_EVAL_SEED)
        bpb = self._bits_per_byte(self.val_loss)
        self.metrics.write(step=step, loss=self.val_loss, split="validation",
                           **({"bits_per_byte": bpb} if np.isfinite(bpb) else {}))

    def _bits_per_byte(self, loss: float) -> float:
        """Validation loss in bits per UTF-8 byte of text (NaN where the data records no
        bytes): nats per token / (ln 2 * bytes per token)."""
        per = getattr(self.val_data, "bytes_per_token", None)
        return float(loss / (np.log(2.0) * per())) if per is not None else float("nan")

    def _save(self, step: int, final: bool = False, **event: Any) -> None:
        """A checkpoint of ``step`` (see :mod:`mpidist.run.checkpoints`). Every rank. A rank
        lost during the save call raises ProcessFailure (the loop recovers; the save is
        abandoned, ``latest`` stays the previous checkpoint), or, under MPI-IO, the one
        line of UnrecoverableFailure."""
        self.checkpoints.save(self.opt, step, self.job_comm(), self.world_size(),
                              extra={"train_config": dataclasses.asdict(self.cfg),
                                     "data": self.train_data.identity()},
                              final=final, **event)
        self.last_saved = step

    def between_steps(self, model: Any, rec: Any) -> Any:
        """If any rank got a preemption signal: checkpoint and stop (every rank)."""
        if rec.step >= self.cfg.steps:
            return model  # the run ends here anyway, with its final checkpoint
        self.checkpoints.before_agreement(self.agreement)  # the async save's progress
        with phase("agreement"):
            signum = self.preemption.agreed(self.job_comm(), self.agreement)
        self.checkpoints.after_agreement(self.agreement, rec.step)
        if not signum:
            return model
        self.preempted = signal_name(signum)
        try:
            self.checkpoints.wait(rec.step)  # the save in flight first
            if self.last_saved != rec.step:
                self._save(rec.step, final=True, reason="preempted")
        except ProcessFailure:  # recovered by the loop; the next agreement preempts again
            self.preempted = ""
            raise
        requeue = ""
        if self.cfg.requeue and self.is_root():
            requeue = requeue_slurm_job()
            log.warning("%s", requeue)
        self.events.write(event="preempted", step=rec.step, signal=self.preempted,
                          world_size=self.world_size(), exit_status=EXIT_PREEMPTED,
                          time=time.time(), **({"requeue": requeue} if requeue else {}))
        if self.is_root():
            how = " (under mpiexec, Ctrl-C reaches the ranks as SIGTERM)" \
                if signum == signal.SIGTERM else ""
            log.warning("preempted by %s%s: stopped after step %d with a checkpoint; the "
                        "ranks exit with status %d", self.preempted, how, rec.step,
                        EXIT_PREEMPTED)
        return None

    def _take_lock_over(self, model: Any, rec: Any) -> Any:
        """Elastic jobs, between steps: a new rank 0 (the old one left) takes the lock over."""
        if self.is_root() and self.opening.lock is None:
            lock = RunLock(self.cfg.out, HOLDER)
            lock.take_over(self.opening.token or None)
            self.opening.lock = lock
        return model

    # -- the end -------------------------------------------------------------------------------
    def _finish(self, outcome: Any, seconds: float, setup_seconds: float) -> dict[str, Any]:
        cfg = self.cfg
        loss = outcome.last.loss if outcome.last is not None else float("nan")
        step = self.opt.step_count
        self.recovery.flush(redone_to=step)  # a recovery no step followed
        self.checkpoints.wait(step)
        if not self.preempted:
            if not np.isfinite(self.val_loss) or cfg.eval_interval == 0:
                self._evaluate(self.model, cfg.steps)
            if self.last_saved != cfg.steps and cfg.steps > 0 and step == cfg.steps \
                    and outcome.steps:
                self._save(cfg.steps, final=True)
        summary = self._summary(loss, seconds, setup_seconds, outcome.steps)
        self.events.write(event="end", step=step, world_size=self.world_size(),
                          time=time.time(), final_loss=loss, validation_loss=self.val_loss,
                          **({"preempted": self.preempted} if self.preempted else {}))
        if self.is_root() and outcome.steps:  # only a run that trained has a summary
            write_summary(summary, cfg.out)
        self.job_comm().Barrier()
        if self.elastic:
            self.opt.free()
        return summary

    def _summary(self, loss: float, seconds: float, setup: float, steps: int) -> dict[str, Any]:
        cfg = self.cfg
        comm = self.job_comm()
        size = comm.Get_size()
        memory = dict(self.opt.memory_report(), host_snapshot=self.checkpoints.snapshot_bytes())
        mem = np.array([memory.get(k, 0) for k in _MEM_KEYS], dtype=np.int64)
        mem_all = C.allgather(mem, comm=comm).reshape(size, len(_MEM_KEYS))
        timers = dict(self.opt.timers)
        io = self.io_seconds + self.checkpoints.blocking_seconds  # training stood still
        tokens_per_step = cfg.global_batch * cfg.block_size
        summary: dict[str, Any] = {
            "strategy": cfg.strategy,
            "world_size": self.world_size(),
            "mesh": _mesh_dict(self.model),
            "steps": cfg.steps,
            "steps_done": int(self.opt.step_count),
            "steps_this_run": steps,
            "final_train_loss": loss,
            "final_validation_loss": self.val_loss,
            "final_validation_bits_per_byte": _or_none(self._bits_per_byte(self.val_loss)),
            "unigram_baseline": self.train_data.unigram_baseline(),
            "tokens_per_second": tokens_per_step * steps / seconds if steps else 0.0,
            "seconds": seconds,
            "time_split_seconds": {"compute": timers.get("compute", 0.0),
                                   "communication": timers.get("communication", 0.0),
                                   "update": timers.get("update", 0.0), "io": io},
            "io_seconds": {"blocking": io,
                           "background": self.checkpoints.background_seconds},
            "memory_bytes_per_rank": [dict(zip(_MEM_KEYS, map(int, row), strict=True))
                                      for row in mem_all],
            "setup_seconds": setup,
            "preempted": self.preempted or None,
            "recoveries": list(self.recovery.history),
            "grown": list(self.regrow.history),
        }
        summary.update(self.timeline.finish(comm))  # per-rank times, speed, stragglers
        if self.elastic:
            summary["inner_strategy"] = self.opt.inner_strategy
            summary["changes"] = [h for h in self.opt.history if h["event"] != "refused"]
        return summary


def _or_none(value: float) -> float | None:
    return value if np.isfinite(value) else None


class _BetweenSteps:
    """A loop hook that calls ``fn(model, record)`` between steps."""

    def __init__(self, fn: Any) -> None:
        self.between_steps = fn


def _mesh_dict(model: Any) -> dict[str, int]:
    s = model.mesh.shape
    return {"pp": s.pp, "dp": s.dp, "tp": s.tp}
