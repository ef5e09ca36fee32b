"""Building a run from its :class:`~mpidist.run.config.TrainConfig`: the base optimizer,
the learning-rate schedule, the strategy, the model and the data."""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any

from mpidist.run.config import TrainConfig

__all__ = ["make_data", "make_optimizer", "make_schedule", "make_strategy", "make_model"]


def make_optimizer(cfg: TrainConfig) -> Any:
    """The base optimizer (:mod:`mpidist.optim`) named by ``cfg.optimizer``. Not collective."""
    from mpidist import optim

    kwargs: dict[str, Any] = {"lr": cfg.lr}
    known = optim.OPTIMIZERS.get(cfg.optimizer)
    if known is not None and "weight_decay" in {f.name for f in fields(known)}:
        kwargs["weight_decay"] = cfg.weight_decay
    return optim.create(cfg.optimizer, **kwargs)


def make_schedule(cfg: TrainConfig) -> Any:
    """Linear warm-up then cosine decay to ``min_lr`` at step ``lr_decay_steps`` (default
    ``steps``), ``min_lr`` after it."""
    from mpidist.optim import WarmupCosineSchedule

    horizon = max(1, cfg.lr_decay_steps or cfg.steps)
    return WarmupCosineSchedule(cfg.lr, total_steps=horizon,
                                warmup_steps=min(cfg.warmup_steps, horizon),
                                min_lr=min(cfg.min_lr, cfg.lr))


def _check_combination(cfg: TrainConfig) -> None:
    """Flags that do not go together, raised before anything is built (pure)."""
    from mpidist.parallel.registry import DATA_PARALLEL, STRATEGIES

    takes = STRATEGIES[cfg.strategy].options
    if (cfg.pp != 1 or cfg.tp != 1) and "pp" not in takes:
        with_pp = [n for n, s in STRATEGIES.items() if "pp" in s.options]
        raise ValueError(f"--pp {cfg.pp} --tp {cfg.tp} need --strategy {' or '.join(with_pp)} "
                         f"(got --strategy {cfg.strategy})")
    if cfg.virtual_stages > 1 and "pp" not in takes:
        raise ValueError(f"--virtual-stages {cfg.virtual_stages} needs a pipeline: --strategy "
                         f"{' or '.join(n for n, s in STRATEGIES.items() if 'pp' in s.options)}"
                         f" (got --strategy {cfg.strategy})")
    level = STRATEGIES[cfg.strategy].level
    if cfg.zero_stage and "zero_stage" not in takes and cfg.zero_stage != level:
        named = DATA_PARALLEL[cfg.zero_stage]
        others = [n for n, s in STRATEGIES.items() if "zero_stage" in s.options]
        raise ValueError(
            f"--zero-stage {cfg.zero_stage} applies to --strategy {', '.join(others)}; for "
            f"data parallelism use --strategy {named} (got --strategy {cfg.strategy})"
        )


def make_strategy(cfg: TrainConfig, comm: Any) -> Any:
    """The strategy optimizer of ``cfg`` on ``comm``, built by the registry
    (:data:`mpidist.parallel.STRATEGIES`) from the options the strategy declares.
    Collective over ``comm`` (the mesh).

    Raises ValueError (the same on every rank, before any communication) for flags that do
    not go together.
    """
    from mpidist.nn import CrossEntropyLoss
    from mpidist.parallel import STRATEGIES, ShardingConfiguration

    _check_combination(cfg)
    spec = STRATEGIES[cfg.strategy]
    config = ShardingConfiguration(dtype=cfg.dtype, micro_batches=cfg.micro_batches,
                                   max_grad_norm=cfg.max_grad_norm, bucket_mb=cfg.bucket_mb,
                                   recompute=cfg.recompute, virtual_stages=cfg.virtual_stages,
                                   device=cfg.device, precision=cfg.precision)
    settings = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    if "min_workers" in spec.options:
        from mpidist.run.elastic import elastic_bounds

        settings["min_workers"], settings["max_workers"] = elastic_bounds(cfg)
        settings["events"] = os.path.join(cfg.out, "events.jsonl")
    return spec(make_optimizer(cfg), config, loss=CrossEntropyLoss(),
                lr_schedule=make_schedule(cfg), comm=comm,
                **{name: settings[name] for name in spec.options})


def make_model(cfg: TrainConfig) -> Any:
    """The GPT of ``cfg`` (unwrapped; its vocabulary the data's when ``cfg`` gives none).
    Not collective."""
    from mpidist.nn import GPT, GPTConfig

    vocab = cfg.vocab_size if cfg.vocab_size is not None else cfg.data_vocab()
    return GPT(GPTConfig(vocab_size=vocab, block_size=cfg.block_size,
                         n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd))


def make_data(cfg: TrainConfig, comm: Any = None) -> tuple[Any, Any]:
    """The train and validation splits: the embedded corpus, a text ``--data``
    (:class:`~mpidist.data.TextCorpus`), a token file (:mod:`mpidist.data.tokens`) or a
    blend of token files (:mod:`mpidist.data.blend`).

    Collective over ``comm`` for a token file (``--data-verify`` checks its hash between the
    ranks; a Megatron or nanoGPT file is hashed between them on first use); None: every
    process alone. Raises the same ValueError on every rank when the data holds an id
    outside ``cfg.vocab_size``.
    """
    from mpidist.data import TextCorpus
    from mpidist.data.tokens import describe_data, largest_id, open_token_data

    blend = cfg.data_blend
    info = None if cfg.data is None else describe_data(cfg.data, binary=cfg.data_binary)
    if blend is None and (info is None or not info.is_tokens):
        return (TextCorpus(cfg.block_size, split="train", path=cfg.data,
                           binary=cfg.data_binary),
                TextCorpus(cfg.block_size, split="validation", path=cfg.data,
                           binary=cfg.data_binary))
    val = None if cfg.val_data is None else describe_data(cfg.val_data)
    if cfg.data_verify:
        from mpidist.data.tokenfile import verify_token_file

        every = [describe_data(p) for _, p in blend] if blend is not None else [info]
        for one in (*every, val):
            if one is not None and one.kind == "tokens":
                verify_token_file(one.path, comm=comm)
    if blend is not None:
        from mpidist.data.blend import open_blend

        train, valid = open_blend(blend, cfg.block_size, val=val, comm=comm)
        parts = [*train.datasets, *getattr(valid, "datasets", [valid])]
        if cfg.val_bytes is not None:
            valid.set_text_bytes(cfg.val_bytes)
    else:
        train, valid = open_token_data(info, cfg.block_size, val=val, comm=comm,
                                       val_bytes=cfg.val_bytes)
        parts = [train, valid]
    vocab = cfg.data_vocab()
    for part in parts:
        top = largest_id(part)
        if top >= vocab:
            raise ValueError(f"--data {part.path} holds token id {top}, outside the "
                             f"vocabulary of {vocab} (--vocab-size)")
    return train, valid
