"""``mpidist prepare``: tokenize a corpus once into one HDF5 token file, on every rank.

Launched as ``mpiexec -n N mpidist prepare INPUT... --out data.h5 --tokenizer T``. The
inputs (text files, JSON Lines, their ``.gz`` forms, directories of them) are split over
the ranks by bytes without splitting a document; the file and its content hash are the
same at any number of ranks (docs/data.md). Exit status: 0 done, 1 failed, 2 bad input
(nothing is written). The work is :func:`mpidist.data.prepare.prepare`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """Register ``mpidist prepare`` and its flags."""
    p = sub.add_parser("prepare", help="tokenize text into one HDF5 token file (under "
                                       "mpiexec: in parallel)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="text files, JSON Lines files (.jsonl), their .gz forms, or "
                        "directories of them (hidden files skipped, files that are not text "
                        "skipped and counted)")
    p.add_argument("--stdlib", action="store_true",
                   help="also the standard-library sources of the embedded corpus (what "
                        "mpidist train uses without --data), each file a document, first")
    p.add_argument("--out", required=True, metavar="FILE", help="the token file to write")
    p.add_argument("--tokenizer", required=True, metavar="T",
                   help="bytes (id = byte value, plus end-of-document 256), bpe:V (a "
                        "byte-level BPE of V tokens trained on a sample of the inputs), or a "
                        "tokenizers JSON file (tokenizer.json)")
    p.add_argument("--text-key", default="text", metavar="KEY",
                   help="the key of a JSON Lines record that holds its text (default: text)")
    p.add_argument("--separator", metavar="TEXT",
                   help="split text files into documents after each occurrence of TEXT "
                        "(default: a text file is one document)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--reuse", action="store_true",
                   help="keep an existing --out prepared from the same inputs (names, sizes, "
                        "SHA-256) with the same tokenizer and options; with --overwrite, "
                        "replace one that differs")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (default: one on rank 0)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from mpidist.core import recorder
    from mpidist.core.comms import world
    from mpidist.data.prepare import prepare
    from mpidist.run.launch.guard import enable_error_agreement

    comm = world(None)
    enable_error_agreement(comm)
    recorder.install()  # a hung prepare dumps what each rank waits for (mpidist doctor)
    recorder.introduce(comm)
    inputs = list(args.inputs)
    if args.stdlib:
        from mpidist.data.corpus import stdlib_paths

        inputs = stdlib_paths() + inputs
    if not inputs:
        raise ValueError("prepare needs at least one INPUT (files or directories) or "
                         "--stdlib")
    summary = prepare(inputs, args.out, args.tokenizer, text_key=args.text_key,
                      separator=args.separator, overwrite=args.overwrite, reuse=args.reuse,
                      progress=args.progress, comm=comm)
    if comm.Get_rank() != 0:
        return 0
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    mb = summary["n_bytes"] / 1e6
    if summary.get("reused"):
        print(f"mpidist prepare: {summary['out']}: reused (prepared before from the same "
              f"inputs with {summary['tokenizer']}): {summary['n_tokens']:,} tokens from "
              f"{summary['n_documents']:,} documents, {mb:,.1f} MB", flush=True)
        print(f"content hash {summary['content_hash']}", flush=True)
        return 0
    print(f"mpidist prepare: {summary['out']}: {summary['n_tokens']:,} tokens "
          f"({summary['tokenizer']}, vocabulary {summary['vocab_size']:,}) from "
          f"{summary['n_documents']:,} documents of {summary['n_sources']} file(s), "
          f"{mb:,.1f} MB"
          + (f"; {summary['skipped']} file(s) skipped as not text" if summary["skipped"]
             else "")
          + f"; {summary['seconds']:.1f} s on {comm.Get_size()} rank(s), "
          f"{mb / max(summary['seconds'], 1e-9):.2f} MB/s", flush=True)
    print(f"content hash {summary['content_hash']}", flush=True)
    return 0
