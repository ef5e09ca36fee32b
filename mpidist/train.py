"""``mpidist train``: train the GPT on the embedded corpus with any strategy.

Launched as ``mpiexec -n N mpidist train ...`` or ``srun mpidist train ...``. A run is
defined by its global batch and seed, so the same flags on a different number of ranks give
the same losses. Every flag has a TOML key of the same name with ``_`` for ``-``
(``--global-batch`` ↔ ``global_batch``); flags given on the command line override the file.

Outputs under ``--out``: ``metrics.jsonl`` (one JSON object per step with ``step`` and
``loss``, and validation rows), ``events.jsonl`` (start, checkpoint, resume, end),
checkpoints ``ckpt-<step>.h5`` with a ``latest`` pointer, ``loss.png`` and ``summary.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

__all__ = ["TrainConfig", "add_parser", "load_toml", "run_training"]

log = logging.getLogger("mpidist.train")

STRATEGY_NAMES = ("ddp", "zero1", "zero2", "zero3", "hybrid", "elastic")


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a training run (the flags of ``mpidist train``)."""

    out: str = "runs/train"
    strategy: str = "ddp"
    pp: int = 1
    tp: int = 1
    dp: int = -1
    zero_stage: int = 0
    schedule: str = "1f1b"
    micro_batches: int = 1
    global_batch: int = 32
    steps: int = 600
    dtype: str = "float32"
    optimizer: str = "adamw"
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    max_grad_norm: float | None = 1.0
    seed: int = 0
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    vocab_size: int = 256
    checkpoint_interval: int = 200
    keep: int = 3
    resume: bool = False
    eval_interval: int = 50
    eval_batches: int = 4
    bucket_mb: float = 25.0
    min_workers: int = 1
    max_workers: int = 1024
    progress: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGY_NAMES:
            raise ValueError(f"strategy={self.strategy!r} is not one of {STRATEGY_NAMES}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype={self.dtype!r} must be float32 or float64")
        if self.schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"schedule={self.schedule!r} must be gpipe or 1f1b")
        for name in ("global_batch", "steps", "micro_batches", "n_layer", "n_head", "n_embd",
                     "block_size", "vocab_size", "keep", "eval_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "steps" else 1):
                raise ValueError(f"{name}={v!r} must be a positive integer")
        for name in ("checkpoint_interval", "eval_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r} must be an integer >= 0 (0 turns it off)")
        if self.zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage={self.zero_stage!r} must be 0, 1 or 2")
        if self.vocab_size < 256:
            raise ValueError(
                f"vocab_size={self.vocab_size} is smaller than the 256 byte values of the corpus"
            )
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")

    @classmethod
    def from_sources(cls, toml: dict[str, Any], flags: dict[str, Any]) -> TrainConfig:
        """Defaults, overridden by the TOML file, overridden by the flags given."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(toml) - known)
        if unknown:
            raise ValueError(f"unknown keys in the config file: {unknown}")
        merged = {**toml, **{k: v for k, v in flags.items() if v is not None}}
        for f in fields(cls):
            if f.name in merged and f.type in ("int", "float") and isinstance(merged[f.name], str):
                merged[f.name] = int(merged[f.name]) if f.type == "int" else float(merged[f.name])
        return cls(**merged)


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML run file; its keys are the flag names with ``_`` for ``-``."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"--config {path!r}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path!r}: {exc}") from None
    # Accept a [train] table or top-level keys.
    data = data.get("train", data)
    return {k.replace("-", "_"): v for k, v in data.items()}


def add_parser(sub: Any) -> None:
    """Register ``mpidist train`` and its flags (the command-line contract)."""
    p = sub.add_parser("train", help="train the GPT on the embedded corpus (under mpiexec/srun)",
                       description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--config", help="TOML file with any of the settings below")
    a("--out", help="output directory (default runs/train)")
    a("--strategy", choices=STRATEGY_NAMES)
    a("--pp", type=int)
    a("--tp", type=int)
    a("--dp", type=int)
    a("--zero-stage", type=int, choices=(0, 1, 2))
    a("--schedule", choices=("gpipe", "1f1b"))
    a("--micro-batches", type=int)
    a("--global-batch", type=int)
    a("--steps", type=int)
    a("--dtype", choices=("float32", "float64"))
    a("--optimizer", help="adamw, adam, sgd, rmsprop, adagrad or lion")
    a("--lr", type=float)
    a("--min-lr", type=float, help="final learning rate of the cosine decay")
    a("--warmup-steps", type=int)
    a("--weight-decay", type=float)
    a("--max-grad-norm", type=float, help="clip by global norm (default 1.0)")
    a("--seed", type=int)
    a("--n-layer", type=int)
    a("--n-head", type=int)
    a("--n-embd", type=int)
    a("--block-size", type=int)
    a("--vocab-size", type=int)
    a("--checkpoint-interval", type=int, help="steps between checkpoints (0: only at the end)")
    a("--keep", type=int, help="checkpoints to keep")
    a("--resume", action="store_const", const=True, help="continue from the latest checkpoint")
    a("--eval-interval", type=int)
    a("--eval-batches", type=int)
    a("--bucket-mb", type=float)
    a("--min-workers", type=int)
    a("--max-workers", type=int)
    a("--no-progress", dest="progress", action="store_const", const=False)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    flags = {f.name: getattr(args, f.name, None) for f in fields(TrainConfig)}
    toml = load_toml(args.config) if args.config else {}
    cfg = TrainConfig.from_sources(toml, flags)
    run_training(cfg)
    return 0


# -- helpers -------------------------------------------------------------------------------
class _JsonLines:
    """Append JSON objects to a file, one per line (rank 0 only)."""

    def __init__(self, path: str, enabled: bool) -> None:
        self.path = path
        self.f = open(path, "a", buffering=1) if enabled else None  # noqa: SIM115

    def write(self, **row: Any) -> None:
        if self.f is not None:
            self.f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def _make_optimizer(cfg: TrainConfig) -> Any:
    from mpidist import optim

    kwargs: dict[str, Any] = {"lr": cfg.lr}
    if cfg.optimizer in ("adamw", "adam", "sgd", "rmsprop", "adagrad", "lion"):
        kwargs["weight_decay"] = cfg.weight_decay
    return optim.create(cfg.optimizer, **kwargs)


def _make_strategy(cfg: TrainConfig, comm: Any) -> Any:
    from mpidist.mesh import ProcessMesh
    from mpidist.nn import CrossEntropyLoss
    from mpidist.optim import WarmupCosineSchedule
    from mpidist.parallel import STRATEGIES, ShardingConfiguration

    schedule = WarmupCosineSchedule(cfg.lr, total_steps=max(1, cfg.steps),
                                    warmup_steps=min(cfg.warmup_steps, max(1, cfg.steps)),
                                    min_lr=min(cfg.min_lr, cfg.lr))
    base = _make_optimizer(cfg)
    if cfg.strategy == "hybrid":
        from mpidist.parallel.hybrid import HybridShardedOptimizer

        config = ShardingConfiguration(dtype=cfg.dtype, micro_batches=cfg.micro_batches,
                                       max_grad_norm=cfg.max_grad_norm, bucket_mb=cfg.bucket_mb)
        return HybridShardedOptimizer(
            base, config, pipeline_parallel_size=cfg.pp, tensor_parallel_size=cfg.tp,
            data_parallel_size=cfg.dp, zero_stage=cfg.zero_stage, schedule=cfg.schedule,
            comm=comm, loss=CrossEntropyLoss(), lr_schedule=schedule,
        )
    if cfg.pp != 1 or cfg.tp != 1:
        raise ValueError(
            f"--pp {cfg.pp} --tp {cfg.tp} need --strategy hybrid (got --strategy {cfg.strategy})"
        )
    if cfg.zero_stage and cfg.strategy != f"zero{cfg.zero_stage}":
        raise ValueError(
            f"--zero-stage {cfg.zero_stage} applies to --strategy hybrid; for data parallelism "
            f"use --strategy zero{cfg.zero_stage} (got --strategy {cfg.strategy})"
        )
    mesh = ProcessMesh(comm, dp=cfg.dp)
    config = ShardingConfiguration(mesh=mesh, dtype=cfg.dtype, micro_batches=cfg.micro_batches,
                                   max_grad_norm=cfg.max_grad_norm, bucket_mb=cfg.bucket_mb)
    return STRATEGIES[cfg.strategy](base, config, loss=CrossEntropyLoss(), lr_schedule=schedule)


class _Progress:
    """tqdm on rank 0 when available and wanted; otherwise a line every few steps."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self.bar = None
        self.enabled = enabled
        self.total = total
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                                file=sys.stderr, mininterval=0.5)
            except ImportError:
                self.bar = None

    def update(self, step: int, loss: float, tok_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            self.bar.update(1)
        elif step % max(1, self.total // 20) == 0 or step == self.total:
            print(f"step {step}/{self.total}  loss {loss:.4f}  {tok_s:,.0f} tok/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _plot(metrics_path: str, out_png: str, baseline: float) -> bool:
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


# -- the run -------------------------------------------------------------------------------
def run_training(cfg: TrainConfig, comm: Any = None) -> dict[str, Any]:
    """Run a training job. Collective over ``comm`` (default COMM_WORLD); returns the summary.

    Every rank validates the configuration identically before any communication, so bad
    settings raise the same ValueError everywhere.
    """
    from mpi4py import MPI

    from mpidist import collectives as C
    from mpidist.data import TextCorpus
    from mpidist.launch.log import setup_logging
    from mpidist.nn import GPT, GPTConfig

    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    setup_logging(rank)
    if cfg.strategy == "elastic":
        from mpidist.launch.elastic_train import run_elastic_training

        return run_elastic_training(cfg, comm)
    if cfg.global_batch % (cfg.micro_batches) != 0:
        raise ValueError(f"--global-batch {cfg.global_batch} is not divisible by "
                         f"--micro-batches {cfg.micro_batches}")
    gpt_cfg = GPTConfig(vocab_size=cfg.vocab_size, block_size=cfg.block_size,
                        n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd)
    opt = _make_strategy(cfg, comm)
    t_setup = time.perf_counter()
    model = opt.wrap(GPT(gpt_cfg), seed=cfg.seed)
    dp_size = model.dp_size
    if cfg.global_batch % (dp_size * cfg.micro_batches):
        raise ValueError(
            f"--global-batch {cfg.global_batch} does not divide into {dp_size} data-parallel "
            f"ranks x {cfg.micro_batches} micro-batches"
        )
    train_data = TextCorpus(cfg.block_size, split="train")
    val_data = TextCorpus(cfg.block_size, split="validation")
    baseline = train_data.unigram_baseline()

    is_root = rank == 0
    if is_root:
        os.makedirs(cfg.out, exist_ok=True)
    comm.Barrier()
    metrics = _JsonLines(os.path.join(cfg.out, "metrics.jsonl"), is_root)
    events = _JsonLines(os.path.join(cfg.out, "events.jsonl"), is_root)
    io_seconds = 0.0

    from mpidist.data import GlobalBatchSampler

    opt.sampler = GlobalBatchSampler(len(train_data), cfg.global_batch, seed=cfg.seed)
    start_step = 0
    if cfg.resume:
        from mpidist.checkpoint.training import load_training, resolve_resume

        path = resolve_resume(cfg.out)
        if path is None:
            log.warning("--resume: no checkpoint under %s; starting from step 0", cfg.out)
        else:
            t0 = time.perf_counter()
            load_training(path, opt, comm=comm)
            io_seconds += time.perf_counter() - t0
            start_step = opt.step_count
            events.write(event="resume", step=start_step, world_size=size,
                         checkpoint=os.path.basename(path), time=time.time())
            if is_root:
                log.info("resumed from %s at step %d on %d ranks", path, start_step, size)
    events.write(event="start", step=start_step, world_size=size, strategy=cfg.strategy,
                 mesh=_mesh_dict(model), config=_jsonable(cfg), time=time.time())
    if is_root:
        n_params = sum(int(np.prod(s)) for _, s in GPT(gpt_cfg).named_parameter_shapes())
        print(f"mpidist train: {cfg.strategy} on {size} rank(s) {_mesh_dict(model)}, GPT "
              f"{cfg.n_layer}x{cfg.n_embd} ({n_params:,} parameters), {cfg.dtype}, global "
              f"batch {cfg.global_batch} x {cfg.block_size} tokens, steps {start_step}->"
              f"{cfg.steps}", flush=True)
        print(model.mesh.node_banner(), end="", flush=True)

    progress = _Progress(cfg.steps, start_step, enabled=is_root and cfg.progress)
    tokens_per_step = cfg.global_batch * cfg.block_size
    loss = float("nan")
    val_loss = float("nan")
    t_train = time.perf_counter()
    steps_done = 0
    last_saved = -1
    for step in range(start_step, cfg.steps):
        t0 = time.perf_counter()
        idx = opt.sampler.next_local(model.dp_rank, dp_size)
        x, y = train_data.batch(idx)
        loss = opt.step(model, (x, y))
        dt = time.perf_counter() - t0
        steps_done += 1
        s = step + 1
        lr = opt.lr_schedule(step) if opt.lr_schedule is not None else cfg.lr
        metrics.write(step=s, loss=loss, split="train", lr=lr, seconds=dt,
                      tokens_per_s=tokens_per_step / dt)
        progress.update(s, loss, tokens_per_step / dt)
        if not np.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {s}; lower --lr")
        if cfg.eval_interval and (s % cfg.eval_interval == 0 or s == cfg.steps):
            val_loss = opt.evaluate(model, val_data, batches=cfg.eval_batches,
                                    global_batch_size=cfg.global_batch, seed=1234)
            metrics.write(step=s, loss=val_loss, split="validation")
        if cfg.checkpoint_interval and (s % cfg.checkpoint_interval == 0) or s == cfg.steps:
            io_seconds += _save(cfg, opt, comm, s, events)
            last_saved = s
    progress.close()
    train_seconds = time.perf_counter() - t_train
    if not np.isfinite(val_loss) or cfg.eval_interval == 0:
        val_loss = opt.evaluate(model, val_data, batches=cfg.eval_batches,
                                global_batch_size=cfg.global_batch, seed=1234)
        metrics.write(step=cfg.steps, loss=val_loss, split="validation")
    if last_saved != cfg.steps and cfg.steps > start_step:
        io_seconds += _save(cfg, opt, comm, cfg.steps, events)

    memory = opt.memory_report()
    mem = np.array([memory.get(k, 0) for k in _MEM_KEYS], dtype=np.int64)
    mem_all = C.allgather(mem, comm=comm).reshape(size, len(_MEM_KEYS))
    timers = dict(opt.timers)
    summary = {
        "strategy": cfg.strategy,
        "world_size": size,
        "mesh": _mesh_dict(model),
        "steps": cfg.steps,
        "steps_this_run": steps_done,
        "final_train_loss": loss,
        "final_validation_loss": val_loss,
        "unigram_baseline": baseline,
        "tokens_per_second": tokens_per_step * steps_done / train_seconds if steps_done else 0.0,
        "seconds": train_seconds,
        "time_split_seconds": {"compute": timers.get("compute", 0.0),
                               "communication": timers.get("communication", 0.0),
                               "update": timers.get("update", 0.0), "io": io_seconds},
        "memory_bytes_per_rank": [dict(zip(_MEM_KEYS, map(int, row), strict=True))
                                  for row in mem_all],
        "setup_seconds": t_train - t_setup,
    }
    events.write(event="end", step=cfg.steps, world_size=size, time=time.time(),
                 final_loss=loss, validation_loss=val_loss)
    metrics.close()
    events.close()
    if is_root:
        with open(os.path.join(cfg.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        plotted = _plot(os.path.join(cfg.out, "metrics.jsonl"),
                        os.path.join(cfg.out, "loss.png"), baseline)
        _print_summary(summary, cfg.out, plotted)
    comm.Barrier()
    return summary


_MEM_KEYS = ("parameters", "gradients", "optimizer_state", "working_peak")


def _mesh_dict(model: Any) -> dict[str, int]:
    s = model.mesh.shape
    return {"pp": s.pp, "dp": s.dp, "tp": s.tp}


def _jsonable(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _save(cfg: TrainConfig, opt: Any, comm: Any, step: int, events: _JsonLines) -> float:
    from mpidist.checkpoint.training import save_training

    t0 = time.perf_counter()
    path = save_training(cfg.out, opt, step=step, keep=cfg.keep, comm=comm,
                         extra={"train_config": _jsonable(cfg)})
    dt = time.perf_counter() - t0
    events.write(event="checkpoint", step=step, world_size=comm.Get_size(),
                 path=os.path.basename(path), seconds=dt, time=time.time())
    return dt


def _print_summary(s: dict[str, Any], out: str, plotted: bool) -> None:
    mb = 2**20
    print("\n== mpidist train summary ==")
    print(f"strategy {s['strategy']} on {s['world_size']} rank(s), mesh {s['mesh']}")
    print(f"final train loss      {s['final_train_loss']:.4f}")
    print(f"final validation loss {s['final_validation_loss']:.4f}   "
          f"(unigram baseline of the corpus: {s['unigram_baseline']:.4f} nats/token)")
    verdict = "below" if s["final_validation_loss"] < s["unigram_baseline"] else "NOT below"
    print(f"validation loss is {verdict} the unigram baseline")
    print(f"throughput            {s['tokens_per_second']:,.0f} tokens/s over "
          f"{s['steps_this_run']} steps in {s['seconds']:.1f} s")
    t = s["time_split_seconds"]
    total = sum(t.values()) or 1.0
    print("time split            " + ", ".join(
        f"{k} {v:.1f} s ({100 * v / total:.0f}%)" for k, v in t.items()))
    print("memory per rank (MiB): rank  params  grads  optimizer  working-peak")
    for r, m in enumerate(s["memory_bytes_per_rank"]):
        print(f"{'':22}{r:>4}  {m['parameters'] / mb:6.2f} {m['gradients'] / mb:6.2f}"
              f"  {m['optimizer_state'] / mb:9.2f}  {m['working_peak'] / mb:12.2f}")
    print(f"outputs in {out}/: metrics.jsonl, events.jsonl, summary.json, checkpoints"
          + (", loss.png" if plotted else ""))
