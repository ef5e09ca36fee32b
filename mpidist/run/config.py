"""The settings of a training run: :class:`TrainConfig`, the TOML file and the flags.

Every flag of ``mpidist train`` has a TOML key of the same name with ``_`` for ``-``
(``--global-batch`` ↔ ``global_batch``); flags given on the command line override the file,
which overrides the defaults. Validation is pure (no communication), so every rank raises
the same error for the same input.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import MISSING, dataclass, fields
from typing import Any

import numpy as np

from mpidist.core.arrays import DEVICES
from mpidist.optim import OPTIMIZERS
from mpidist.parallel.config import PRECISIONS, RECOMPUTE
from mpidist.parallel.pipeline import SCHEDULES
from mpidist.parallel.precision import compute_dtype
from mpidist.parallel.redundancy import MODES as REDUNDANCY
from mpidist.parallel.registry import DEFAULT_STRATEGY, STRATEGIES
from mpidist.parallel.regrow import MODES as REGROW

__all__ = ["COMPRESSION_METHODS", "STRATEGY_NAMES", "TrainConfig", "add_train_arguments",
           "check_output_directory", "load_toml"]

STRATEGY_NAMES = tuple(STRATEGIES)
COMPRESSION_METHODS = ("fp16", "bf16", "topk", "powersgd")

_POSITIVE = ("global_batch", "steps", "micro_batches", "n_layer", "n_head", "n_embd",
             "block_size", "vocab_size", "keep", "eval_batches", "sync_period", "shard_group",
             "powersgd_rank", "virtual_stages")


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a training run (the flags of ``mpidist train``)."""

    out: str = "runs/train"
    strategy: str = DEFAULT_STRATEGY
    pp: int = 1
    tp: int = 1
    dp: int = -1
    zero_stage: int = 0
    sync_period: int = 8
    shard_group: int = 1
    compression: str = "topk"
    topk_ratio: float = 0.01
    powersgd_rank: int = 4
    staleness: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str = "none"
    micro_batches: int = 1
    global_batch: int = 32
    steps: int = 600
    dtype: str = "float32"
    device: str = "cpu"
    precision: str = "full"
    optimizer: str = "adamw"
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    lr_decay_steps: int | None = None
    weight_decay: float = 0.1
    max_grad_norm: float | None = 1.0
    seed: int = 0
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    vocab_size: int | None = None
    data: str | None = None
    data_blend: list | None = None
    data_binary: bool = False
    val_data: str | None = None
    val_bytes: int | None = None
    data_verify: bool = False
    data_reweight: bool = False
    checkpoint_interval: int = 200
    checkpoint_async: bool = False
    keep: int = 3
    resume: bool | str = False
    overwrite: bool = False
    requeue: bool = False
    eval_interval: int = 50
    eval_batches: int = 4
    bucket_mb: float = 25.0
    min_workers: int = 1
    max_workers: int = 1024
    hang_timeout: float = 300.0
    hang_abort: bool = False
    trace: str | None = None
    straggler_interval: int = 10
    straggler_margin: float = 0.3
    redundancy: str = "buddy"
    regrow: str = "spawn"
    progress: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, f.type, getattr(self, f.name))
        if self.strategy not in STRATEGY_NAMES:
            raise ValueError(f"strategy={self.strategy!r} is not one of {STRATEGY_NAMES}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype={self.dtype!r} must be float32 or float64")
        if self.device not in DEVICES and not re.fullmatch(r"cuda:\d+", self.device):
            raise ValueError(f"device={self.device!r} must be one of {DEVICES} (or cuda:N)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} must be one of {PRECISIONS}")
        if self.device == "cpu":
            compute_dtype(self.precision, np)  # mixed precision needs a GPU: the reason
        if self.precision != "full" and self.dtype != "float32":
            raise ValueError(f"--precision {self.precision} keeps float32 master weights: "
                             f"--dtype {self.dtype} must be float32")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} must be one of {SCHEDULES}")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError(f"--virtual-stages {self.virtual_stages} needs --schedule "
                             f"interleaved (got --schedule {self.schedule})")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r} must be one of {RECOMPUTE}")
        if self.redundancy not in REDUNDANCY:
            raise ValueError(f"redundancy={self.redundancy!r} must be one of {REDUNDANCY}")
        if self.regrow not in REGROW:
            raise ValueError(f"regrow={self.regrow!r} must be one of {REGROW}")
        if self.compression not in COMPRESSION_METHODS:
            raise ValueError(f"compression={self.compression!r} is not one of "
                             f"{COMPRESSION_METHODS}")
        for name in _POSITIVE:
            v = getattr(self, name)
            if v is not None and v < (0 if name == "steps" else 1):
                raise ValueError(f"{name}={v!r} must be a positive integer")
        for name in ("checkpoint_interval", "eval_interval", "staleness", "warmup_steps"):
            v = getattr(self, name)
            if v < 0:
                raise ValueError(f"{name}={v!r} must be an integer >= 0")
        if isinstance(self.resume, str) and self.resume != "auto":
            raise ValueError(f"resume={self.resume!r} must be true, false or \"auto\"")
        if self.lr_decay_steps is not None and self.lr_decay_steps < 1:
            raise ValueError(f"lr_decay_steps={self.lr_decay_steps!r} must be a positive "
                             "integer")
        if self.hang_timeout < 0:
            raise ValueError(f"hang_timeout={self.hang_timeout!r} must be >= 0 seconds "
                             "(0: no timeout)")
        if self.trace is not None:
            from mpidist.run.trace import parse_trace_steps

            parse_trace_steps(self.trace)
            if self.strategy == "elastic":
                raise ValueError("--trace is not available with --strategy elastic (its "
                                 "workers join and leave between steps)")
        if self.straggler_interval < 0:
            raise ValueError(f"straggler_interval={self.straggler_interval!r} must be an "
                             "integer >= 0 (0: no reports)")
        if not self.straggler_margin > 0:
            raise ValueError(f"straggler_margin={self.straggler_margin!r} must be > 0 (a "
                             "fraction: 0.3 names a rank 30% slower than the fastest)")
        if not 0 < self.topk_ratio <= 1:
            raise ValueError(f"topk_ratio={self.topk_ratio!r} must be in (0, 1]")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage!r} must be 0, 1, 2 or 3")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")
        if self.global_batch < self.micro_batches:
            raise ValueError(f"--global-batch {self.global_batch} is smaller than "
                             f"--micro-batches {self.micro_batches}")
        self._check_data_settings()
        self.data_vocab()  # the data is checked (and its vocabulary) before anything runs

    def _check_data_settings(self) -> None:
        """The data flags together (pure); a blend is put in its canonical form."""
        if self.data_blend is not None:
            from mpidist.data.blend import parse_blend

            if self.data is not None:
                raise ValueError(f"--data {self.data} and --data-blend both given: give one "
                                 "(a blend of one file is --data-blend 1 PATH)")
            if self.data_binary:
                raise ValueError("--data-binary applies to text; --data-blend takes token "
                                 "files")
            object.__setattr__(self, "data_blend", parse_blend(self.data_blend))
        if self.val_bytes is not None:
            if self.val_bytes < 1:
                raise ValueError(f"val_bytes={self.val_bytes!r} must be a positive integer")
            if self.data_blend is not None and self.val_data is None:
                raise ValueError("--val-bytes names the bytes of one validation file: with "
                                 "--data-blend it needs --val-data")

    def data_vocab(self) -> int:
        """The model's vocabulary: ``vocab_size``, or the data's (256 for text, the
        tokenizer's for a token file or a blend that holds one). Reads the data's header,
        not the data. Raises ValueError when ``--data``, ``--data-blend`` or
        ``--val-data`` is unusable (a blend of text, or of token files with different
        tokenizers), when a vocabulary is needed and not given (Megatron's and nanoGPT's
        files name none), or when ``vocab_size`` is smaller than the data's."""
        from mpidist.data.blend import blend_vocabulary
        from mpidist.data.tokens import describe_data

        if self.data_blend is not None:
            have, named = blend_vocabulary(self.data_blend)
            is_tokens = True
        else:
            info = None if self.data is None else describe_data(self.data,
                                                                binary=self.data_binary)
            have = 256 if info is None else info.vocab_size
            is_tokens = info is not None and info.is_tokens
            named = f"--data {self.data} ({info.kind}'s format)" if info is not None else ""
        if self.val_data is not None:
            if not is_tokens:
                raise ValueError(f"--val-data {self.val_data} needs a token file as --data "
                                 "(text is split by itself)")
            if not describe_data(self.val_data).is_tokens:
                raise ValueError(f"--val-data {self.val_data}: not a token file")
        if have is None:
            if self.vocab_size is None:
                raise ValueError(f"{named} names no tokenizer: give its vocabulary with "
                                 "--vocab-size (GPT-2's is 50257)")
            return self.vocab_size
        if self.vocab_size is None:
            return have
        if self.vocab_size < have:
            what = "the 256 byte values of the corpus" if have == 256 and not is_tokens \
                else f"the vocabulary of {self.data or 'the blend'}'s tokenizer ({have})"
            raise ValueError(f"vocab_size={self.vocab_size} is smaller than {what}")
        return self.vocab_size

    @classmethod
    def from_sources(cls, toml: dict[str, Any], flags: dict[str, Any]) -> TrainConfig:
        """Defaults, overridden by the TOML file, overridden by the flags given."""
        toml = dict(toml)
        if isinstance(toml.get("data"), list):  # data = [{path = ..., weight = ...}, ...]
            if "data_blend" in toml:
                raise ValueError("config file: data (a list) and data_blend both given")
            toml["data_blend"] = toml.pop("data")
        if any(flags.get(k) is not None for k in ("data", "data_blend")):
            toml.pop("data", None)  # the command line's data replaces the file's
            toml.pop("data_blend", None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(toml) - known)
        if unknown:
            raise ValueError(f"unknown keys in the config file: {unknown}")
        for f in fields(cls):
            if f.name in toml:
                _check_type(f.name, f.type, toml[f.name], where="config file key ")
        merged = {**toml, **{k: v for k, v in flags.items() if v is not None}}
        return cls(**merged)

    @classmethod
    def default(cls, name: str) -> Any:
        """The default value of setting ``name``."""
        for f in fields(cls):
            if f.name == name:
                return f.default if f.default is not MISSING else None
        raise KeyError(name)


_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
    "float | None": (int, float, type(None)), "str | None": (str, type(None)),
    "int | None": (int, type(None)), "bool | str": (bool, str),
    "list | None": (list, tuple, type(None)),
}


def _check_type(name: str, annotation: Any, value: Any, where: str = "") -> None:
    """Raise a ValueError naming ``name`` if ``value`` is not of the setting's type."""
    want = _TYPES[str(annotation)]
    if isinstance(value, bool) and bool not in want:
        ok = False
    else:
        ok = isinstance(value, want)
    if not ok:
        kind = str(annotation).replace(" | None", "")
        raise ValueError(f"{where}{name}={value!r} must be of type {kind} "
                         f"(got {type(value).__name__})")


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


def check_output_directory(out: str) -> None:
    """Raise a ValueError if ``out`` cannot be created or written. Not collective.

    Every rank checks the same path, so on a shared file system every rank raises the same
    error before anything is communicated or written.
    """
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise ValueError(f"--out {out!r} exists and is not a directory")
        if not os.access(out, os.W_OK | os.X_OK):
            raise ValueError(f"--out {out!r} is not writable")
        return
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out!r} cannot be created: {parent!r} is not writable")


# (flag, type or action, choices, help) of every setting, in the order of --help.
_FLAGS: list[tuple[str, Any, Any, str]] = [
    ("--out", str, None, "output directory: checkpoints, metrics, events, plot"),
    ("--strategy", str, STRATEGY_NAMES, "how the work is distributed"),
    ("--pp", int, None, "pipeline-parallel size (--strategy hybrid)"),
    ("--tp", int, None, "tensor-parallel size (--strategy hybrid)"),
    ("--dp", int, None, "data-parallel size; -1: the ranks left"),
    ("--zero-stage", int, (0, 1, 2, 3),
     "sharding level (ZeRO stage) of --strategy hybrid, elastic, localsgd, compressed "
     "(0: replicated)"),
    ("--sync-period", int, None, "local steps between averages (--strategy localsgd)"),
    ("--shard-group", int, None,
     "ranks per replica of --strategy localsgd, which shard it at --zero-stage >= 1"),
    ("--compression", str, COMPRESSION_METHODS, "gradient codec (--strategy compressed)"),
    ("--topk-ratio", float, None, "fraction of each bucket sent (--compression topk)"),
    ("--powersgd-rank", int, None, "rank of the factors (--compression powersgd)"),
    ("--staleness", int, None, "steps a gradient may stay in flight (--strategy async)"),
    ("--schedule", str, SCHEDULES,
     "pipeline schedule (--pp > 1); interleaved runs --virtual-stages model chunks per "
     "stage (the bubble divided by them; --micro-batches a multiple of --pp); zero-bubble "
     "splits each backward into the input gradient and the weight gradients, deferred "
     "into the bubble"),
    ("--virtual-stages", int, None,
     "model chunks per pipeline stage (--schedule interleaved; the model needs at least "
     "--pp x this many units: --n-layer + 2)"),
    ("--recompute", str, RECOMPUTE,
     "activation checkpointing: keep only each block's input, recompute the rest in backward"),
    ("--micro-batches", int, None, "micro-batches per step"),
    ("--global-batch", int, None, "samples per step over all ranks"),
    ("--steps", int, None, "optimizer steps of the whole run"),
    ("--dtype", str, ("float32", "float64"),
     "parameter and gradient dtype (the master weights' under --precision mixed-*)"),
    ("--device", str, None,
     "cpu (NumPy) or cuda (CuPy: GPU = rank on the node modulo the node's GPUs; cuda:N "
     "picks one)"),
    ("--precision", str, PRECISIONS,
     "full: everything in --dtype; mixed-fp16: 16-bit parameters and activations for "
     "compute, float32 master weights and gradient reduction, dynamic loss scaling (a GPU "
     "only; mixed-bf16 is refused for now: the layer kernels have no bfloat16 arrays)"),
    ("--optimizer", str, tuple(OPTIMIZERS), "the base optimizer"),
    ("--lr", float, None, "peak learning rate"),
    ("--min-lr", float, None, "final learning rate of the cosine decay"),
    ("--warmup-steps", int, None, "steps of linear warm-up"),
    ("--lr-decay-steps", int, None,
     "steps over which the learning rate decays to --min-lr (none: --steps of the run's "
     "first start; --resume keeps it)"),
    ("--weight-decay", float, None, "weight decay"),
    ("--max-grad-norm", float, None, "clip by global norm"),
    ("--seed", int, None, "seed of the initial weights and of the sampler"),
    ("--n-layer", int, None, "transformer blocks"),
    ("--n-head", int, None, "attention heads"),
    ("--n-embd", int, None, "embedding width"),
    ("--block-size", int, None, "tokens per sample"),
    ("--vocab-size", int, None,
     "vocabulary (none: the data's: 256 for text, the tokenizer's for a token file; a "
     "larger one rounds up; needed for Megatron and nanoGPT files)"),
    ("--data", str, None,
     "train on a token file (mpidist prepare's data.h5, Megatron's PREFIX of PREFIX.bin + "
     "PREFIX.idx, nanoGPT's train.bin) or on a text file or directory of files, "
     "byte-level; none: the embedded corpus. Text must be UTF-8 with few control bytes; "
     "in a directory, other files are skipped"),
    ("--data-blend", "blend", None,
     "train on a blend of token files in fixed proportions: WEIGHT PATH WEIGHT PATH ... "
     "(weights normalized to sum 1; TOML: data = [{path = ..., weight = ...}, ...]); each "
     "step's samples come from the sources by the weights, the same at every world size"),
    ("--data-binary", "store_const", None,
     "train on the bytes of --data even if they are not text"),
    ("--val-data", str, None,
     "validation token file (none: documents held out of --data, or nanoGPT's val.bin; of "
     "each source of a blend, blended alike)"),
    ("--val-bytes", int, None,
     "UTF-8 bytes of the validation text, for bits per byte where the data records none "
     "(Megatron's and nanoGPT's files)"),
    ("--data-verify", "store_const", None,
     "check the token file's content hash before training (reads it once, split over the "
     "ranks)"),
    ("--data-reweight", "store_const", None,
     "on --resume, accept a changed --data-blend (or --data): the position continues, the "
     "proportions change"),
    ("--checkpoint-interval", int, None, "steps between checkpoints (0: only at the end)"),
    ("--checkpoint-async", "store_const", None,
     "write the periodic checkpoints in the background: a save copies the state into host "
     "memory and training goes on while a thread on each rank writes it; it commits (and "
     "`latest` moves) at a later step boundary once every rank is done. The next save, "
     "SIGTERM/SIGUSR1 and the end of the run wait for it; the last checkpoint is written "
     "blocking. Only the default posix I/O mode writes in the background: with "
     "MPIDIST_CHECKPOINT_IO=mpio or serial saves stay blocking"),
    ("--keep", int, None, "checkpoints to keep"),
    ("--resume", "resume", None,
     "continue from the latest checkpoint under --out, with the settings it was trained "
     "with (an error if there is none); --resume auto: continue if there is one, else start"),
    ("--overwrite", "store_const", None,
     "start a new run in an --out that holds another run's checkpoints, deleting them"),
    ("--requeue", "store_const", None,
     "on SIGTERM/SIGUSR1, after the checkpoint, requeue the Slurm job (scontrol requeue)"),
    ("--eval-interval", int, None, "steps between validation losses (0: only at the end)"),
    ("--eval-batches", int, None, "global batches per validation loss"),
    ("--bucket-mb", float, None, "gradient bucket size in MiB"),
    ("--min-workers", int, None, "fewest workers of --strategy elastic"),
    ("--max-workers", int, None, "most workers of --strategy elastic"),
    ("--hang-timeout", float, None,
     "seconds a rank may stay inside one MPI call, or make no progress at all, before its "
     "flight recorder is dumped into OUT/hang (read by mpidist doctor OUT); the job goes "
     "on; 0: never"),
    ("--hang-abort", "store_const", None,
     "after dumping for a hang, end the job (MPI_Abort) instead of only reporting"),
    ("--trace", str, None,
     "FIRST:LAST: record every rank's steps FIRST to LAST (forward and backward per unit, "
     "pipeline blocks, every MPI call, data, checkpoints) into OUT/trace.json, a "
     "Chrome/Perfetto trace (open it in https://ui.perfetto.dev), and for a pipeline "
     "OUT/schedule.png; none: nothing is recorded"),
    ("--straggler-interval", int, None,
     "steps between the ranks' exchanges of their times (one small allgather): a rank "
     "computing more than --straggler-margin slower than the fastest rank doing the same "
     "work in two reports in a row is named (events.jsonl, the progress line, the "
     "summary); 0: no reports"),
    ("--straggler-margin", float, None,
     "how much slower (a fraction) a rank's compute time may be than the fastest's"),
    ("--redundancy", str, REDUNDANCY,
     "copies for in-job recovery from a lost rank (MPI with fault tolerance: Open MPI 5 "
     "under mpiexec --with-ft ulfm; ddp, zero1-3): buddy keeps each rank's shard in its "
     "neighbour's memory and the survivors go on; none: a lost rank ends the job"),
    ("--regrow", str, REGROW,
     "after in-job recovery: spawn replacements at the next step boundary, up to the size "
     "the run started with or the size in <out>/elastic-target, their state sent by the "
     "survivors; none: go on smaller"),
]


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """Add every setting of :class:`TrainConfig` as a flag, with its help and default.

    The flags default to None so that only the flags given override the TOML file.
    """
    p.add_argument("--config", help="TOML file with any of the settings below, keys as the "
                   "flags with _ for - (default: none)")
    for flag, kind, choices, text in _FLAGS:
        default = TrainConfig.default(flag[2:].replace("-", "_"))
        shown = "none" if default is None else ("off" if default is False else default)
        help_text = f"{text} (default: {shown})"
        if kind == "store_const":
            p.add_argument(flag, action="store_const", const=True, help=help_text)
        elif kind == "resume":
            p.add_argument(flag, nargs="?", const=True, choices=("auto",), metavar="auto",
                           help=help_text)
        elif kind == "blend":
            p.add_argument(flag, nargs="+", metavar="W PATH", help=help_text)
        else:
            p.add_argument(flag, type=kind, choices=choices, help=help_text)
    p.add_argument("--no-progress", dest="progress", action="store_const", const=False,
                   help="no progress bar (default: a bar on rank 0)")
