"""``mpidist inspect | diff | export | sample``: single-process tools on checkpoints."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

__all__ = ["add_parsers", "sample_text"]


def _resolve(path: str) -> str:
    """A checkpoint file, or a run directory's latest checkpoint."""
    from mpidist.checkpoint import latest_checkpoint

    if os.path.isdir(path):
        found = latest_checkpoint(path)
        if found is None:
            raise ValueError(f"no checkpoint in directory {path!r}")
        return found
    return path


def _inspect(args: argparse.Namespace) -> int:
    from mpidist.checkpoint import format_inspect, inspect

    report = inspect(_resolve(args.checkpoint), verify=args.verify)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_inspect(report))
    return 0


def _diff(args: argparse.Namespace) -> int:
    """Exit status as diff(1)'s: 0 the same (within the tolerance), 1 different, 2 trouble."""
    from mpidist.checkpoint import diff, diff_found, diff_summary, format_diff

    result = diff(_resolve(args.a), _resolve(args.b), rtol=args.rtol, atol=args.atol)
    if args.json:
        print(json.dumps({**result, "summary": diff_summary(result)}, indent=2, default=str))
    else:
        print(format_diff(result))
    return 1 if diff_found(result) else 0


def _export(args: argparse.Namespace) -> int:
    from mpidist.checkpoint import export

    keys = export(_resolve(args.checkpoint), args.to)
    print(f"exported {len(keys)} tensors to {args.to}")
    return 0


def _codec(path: str, data: dict[str, Any], tokenizer: str | None, vocab: int) -> Any:
    """What encodes the prompt and decodes the ids: the tokenizer the checkpoint's data
    had, else ``--tokenizer``; bytes for text data (and checkpoints from before the
    tokenizer was recorded)."""
    from mpidist.data import TextCorpus
    from mpidist.data.tokenizer import Tokenizer, load_tokenizer

    record = data.get("tokenizer") if isinstance(data, dict) else None
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    elif record and record.get("json"):
        tok = Tokenizer.from_record(record)
    elif data.get("kind") in ("megatron", "nanogpt", "blend"):
        what = "a blend of Megatron's and nanoGPT's files" if data["kind"] == "blend" else \
            f"{data['kind']}'s format"
        raise ValueError(f"{path}: its data ({what}) named no tokenizer: "
                         "give --tokenizer tokenizer.json (the one the data was made with)")
    else:
        return TextCorpus
    if tok.vocab_size > vocab:
        raise ValueError(f"--tokenizer {tokenizer}: vocabulary {tok.vocab_size} is larger than "
                         f"the model's {vocab}")
    return tok


def sample_text(checkpoint: str, prompt: str, *, tokens: int = 200, temperature: float = 0.8,
                top_k: int | None = 40, seed: int = 0, tokenizer: str | None = None) -> str:
    """Generate text from a checkpoint of ``mpidist train`` (its GPT), encoding and
    decoding with the tokenizer of the data it was trained on (``tokenizer``: a
    ``tokenizer.json`` or ``bytes``, for data that named none). Not collective."""
    from mpidist.checkpoint import read_metadata, read_tensor
    from mpidist.nn import GPT, GPTConfig

    path = _resolve(checkpoint)
    attrs, infos = read_metadata(path)
    train = attrs.get("extra", {}).get("train_config")
    if not train:
        raise ValueError(f"{path!r} was not written by `mpidist train` (no train_config)")
    codec = _codec(path, attrs.get("extra", {}).get("data") or {}, tokenizer,
                   int(train["vocab_size"]))
    cfg = GPTConfig(vocab_size=train["vocab_size"], block_size=train["block_size"],
                    n_layer=train["n_layer"], n_head=train["n_head"], n_embd=train["n_embd"])
    model = GPT(cfg)
    dtype = np.dtype(attrs.get("dtype", "float32"))
    params, _ = model.build(dtype)
    for name, view in params.views().items():
        view[...] = read_tensor(path, f"params/{name}")
    ids = codec.encode(prompt)
    if ids.size == 0:
        raise ValueError("--prompt must not be empty")
    out = model.generate(ids[None, :], tokens, temperature=temperature, seed=seed, top_k=top_k)
    return codec.decode(out[0])


def _sample(args: argparse.Namespace) -> int:
    text = sample_text(args.checkpoint, args.prompt, tokens=args.tokens,
                       temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                       tokenizer=args.tokenizer)
    sys.stdout.write(text + "\n")
    return 0


def add_parsers(sub: Any) -> None:
    """Register the checkpoint tools."""
    p = sub.add_parser("inspect", help="show a checkpoint: tensors, shapes, norms, metadata")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint file or run directory")
    p.add_argument("--verify", action="store_true", help="check every dataset's checksum")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("diff", help="compare two checkpoints tensor by tensor; exit status 1 "
                                    "when they differ (as diff(1))",
                       description="Lists the tensors that differ beyond the tolerance and "
                                   "ends with a summary line. Exit status: 0 the same, 1 "
                                   "different, 2 trouble.")
    p.add_argument("a", metavar="A", help="checkpoint file or run directory")
    p.add_argument("b", metavar="B", help="checkpoint file or run directory")
    p.add_argument("--rtol", type=float, default=0.0,
                   help="relative tolerance: |a-b| <= atol + rtol*|b| is the same (default: 0)")
    p.add_argument("--atol", type=float, default=0.0,
                   help="absolute tolerance (default: 0, with --rtol 0: exactly equal)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_diff)
    p = sub.add_parser("export", help="consolidated weights to .npz (or .safetensors)")
    p.add_argument("checkpoint", metavar="CKPT")
    p.add_argument("--to", required=True, metavar="FILE", help="model.npz or model.safetensors")
    p.set_defaults(func=_export)
    p = sub.add_parser("sample", help="generate text from a checkpoint of `mpidist train`")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint file or run directory")
    p.add_argument("--prompt", required=True, metavar="TEXT")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", metavar="T",
                   help="tokenizer.json (or bytes) to encode and decode with, for data that "
                        "named none (Megatron, nanoGPT); default: the data's")
    p.set_defaults(func=_sample)
