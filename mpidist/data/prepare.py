"""``prepare``: tokenize a corpus once, on every rank in parallel, into one token file.

Collective over the communicator it is given; run it as ``mpiexec -n N mpidist prepare
INPUT... --out data.h5 --tokenizer T``. In order:

1. Every rank checks the arguments (the same error everywhere, before anything is
   communicated or written) and lists the inputs (:mod:`mpidist.data.sources`).
2. The inputs are read once between the ranks (file ``i`` by rank ``i mod n``): each file's
   SHA-256, and for text files the text check of ``mpidist train --data`` (UTF-8, few control
   bytes). A file given by name that is not text is an error; in a directory it is skipped
   and counted.
3. The tokenizer: ``bytes``, the user's file, or for ``bpe:V`` a byte-level BPE trained on
   rank 0 on :func:`mpidist.data.sources.first_documents` (from each input in order, its
   first documents up to its share, by size, of :data:`BPE_SAMPLE_BYTES`) and broadcast.
   One tokenizer thread per rank when there are several (``RAYON_NUM_THREADS=1``).
4. Each rank tokenizes the documents of its byte range into a spill file next to the output
   (any error there, e.g. a JSON Lines line that is not JSON, is agreed on and raised on
   every rank; nothing is left behind).
5. The parts are written at agreed offsets into one file under a temporary name
   (:mod:`mpidist.data.tokenwrite`), hashed, and the file is renamed to ``out``.

The token stream, the file and its content hash are the same at any number of ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
import uuid
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpidist.core import collectives as C
from mpidist.core.comms import bcast_json, size_rank, world
from mpidist.data.sampler import split_points
from mpidist.data.sources import Unit, first_documents, list_units, read_segments, work_ranges
from mpidist.data.textfiles import TextChecker, count_ids, read_chunks
from mpidist.data.tokenizer import Tokenizer, load_tokenizer, parse_tokenizer_arg, train_bpe
from mpidist.data.tokenwrite import Layout, Part, create_layout, set_content_hash, write_part

__all__ = ["BPE_SAMPLE_BYTES", "prepare"]

#: Bytes of text a ``bpe:V`` tokenizer is trained on (see the module docstring).
BPE_SAMPLE_BYTES = 32 << 20
#: Text encoded per call of the tokenizer.
BATCH_BYTES = 1 << 20


def _allgather_json(obj: Any, comm: Any) -> list[Any]:
    """Every rank's JSON-able ``obj``, in rank order. Collective over ``comm``."""
    size, _ = size_rank(comm)
    if size == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).copy()
    counts = C.allgather(np.array([data.size], dtype=np.int64), comm=comm)
    buf = np.zeros(int(counts.sum()), dtype=np.uint8)
    start = int(counts[:comm.Get_rank()].sum())
    buf[start:start + data.size] = data
    C.allgather_varied(buf, [int(c) for c in counts], comm=comm)
    out, at = [], 0
    for c in counts:
        out.append(json.loads(buf[at:at + int(c)].tobytes().decode()))
        at += int(c)
    return out


def _on_root(fn: Any, comm: Any) -> Any:
    """``fn()`` on rank 0, its JSON-able result on every rank. Collective. A ValueError or
    OSError there is raised as a ValueError on every rank, anything else as a
    RuntimeError, so that no rank waits for a rank that failed."""
    _, rank = size_rank(comm)
    reply: dict[str, Any] = {}
    if rank == 0:
        try:
            reply = {"value": fn()}
        except (ValueError, OSError) as exc:
            reply = {"error": str(exc), "bad_input": True}
        except Exception as exc:  # noqa: BLE001 - carried to every rank, then raised
            reply = {"error": f"{type(exc).__name__}: {exc}", "bad_input": False}
    reply = bcast_json(reply, comm)
    if "error" in reply:
        raise (ValueError if reply["bad_input"] else RuntimeError)(reply["error"])
    return reply["value"]


def _agree(error: str | None, comm: Any) -> None:
    """Raise the first rank's error on every rank, if any rank has one. Collective."""
    errors = [e for e in _allgather_json(error, comm) if e]
    if errors:
        raise ValueError(errors[0])


def _check_arguments(inputs: Sequence[str], out: str, tokenizer: str, text_key: str,
                     separator: str | None, overwrite: bool, reuse: bool) -> None:
    """Pure checks every rank makes alike."""
    if not inputs:
        raise ValueError("prepare needs at least one INPUT (files or directories)")
    if os.path.isdir(out):
        raise ValueError(f"--out {out!r} is a directory; give the token file's name "
                         "(e.g. data.h5)")
    if os.path.exists(out) and not overwrite and not reuse:
        raise ValueError(f"--out {out!r} exists; give --overwrite to replace it (or --reuse "
                         "to keep it when it was prepared from the same inputs)")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out!r}: its directory {parent!r} does not exist or is "
                         "not writable")
    parse_tokenizer_arg(tokenizer)
    if not text_key:
        raise ValueError("--text-key must not be empty")
    if separator is not None and not separator:
        raise ValueError("--separator must not be empty")
    for given in inputs:
        if os.path.abspath(given) == os.path.abspath(out):
            raise ValueError(f"--out {out!r} is also an input")


def _scan_unit(unit: Unit) -> dict[str, Any]:
    """SHA-256 of the file's bytes; for a text file, why it is not text (or None)."""
    import gzip

    digest = hashlib.sha256()
    with open(unit.path, "rb") as f:
        for chunk in read_chunks(f):
            digest.update(chunk)
    problem = None
    if not unit.jsonl:
        checker = TextChecker()
        try:
            with (gzip.open(unit.path, "rb") if unit.gz else open(unit.path, "rb")) as f:
                for chunk in read_chunks(f):
                    checker.feed(chunk)
                    if checker.problem:
                        break
        except (OSError, EOFError) as exc:
            checker.problem = f"cannot be read ({exc})"
        problem = checker.finish()
    return {"sha256": digest.hexdigest(), "problem": problem}


def _scan_units(units: list[Unit], from_dir: list[bool], comm: Any
                ) -> tuple[list[Unit], list[str], list[str]]:
    """The units to tokenize, their SHA-256, and the directories' files skipped as not
    text. Collective: the files are read between the ranks."""
    size, rank = size_rank(comm)
    mine = {i: _scan_unit(u) for i, u in enumerate(units) if i % size == rank}
    found: dict[int, dict[str, Any]] = {}
    for part in _allgather_json({str(k): v for k, v in mine.items()}, comm):
        found.update({int(k): v for k, v in part.items()})
    keep, sums, skipped = [], [], []
    for i, u in enumerate(units):
        problem = found[i]["problem"]
        if problem is not None and not from_dir[i]:
            raise ValueError(f"{u.name} is not text ({problem})")
        if problem is not None:
            skipped.append(u.name)
            continue
        keep.append(u)
        sums.append(found[i]["sha256"])
    if not keep:
        raise ValueError(f"none of the {len(units)} input file(s) is text (e.g. "
                         f"{skipped[0]})")
    return keep, sums, skipped


def _tokenizer(arg: str, units: list[Unit], separator: str | None, text_key: str,
               comm: Any) -> Tokenizer:
    """The tokenizer of ``arg`` on every rank (``bpe:V`` trained on rank 0). Collective."""
    size, rank = size_rank(comm)
    single = size > 1
    kind, vocab = parse_tokenizer_arg(arg)
    if kind != "bpe":
        return load_tokenizer(arg, single_thread=single)

    def train() -> dict[str, Any]:
        sample = first_documents(units, BPE_SAMPLE_BYTES, separator=_sep(separator),
                                 text_key=text_key)
        return train_bpe(sample, int(vocab or 0), single_thread=single).record()

    return Tokenizer.from_record(_on_root(train, comm), single_thread=single)


def _sep(separator: str | None) -> bytes | None:
    return separator.encode("utf-8") if separator else None


class _Progress:
    """Rank 0's progress: documents, MB/s and the time left of its share."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = max(total, 1), enabled
        self.t0 = self.last = time.perf_counter()
        self.docs = self.nbytes = 0
        self.bar = None
        if enabled:
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr,
                                desc="prepare (rank 0's share)", mininterval=0.5)

    def update(self, docs: int, nbytes: int) -> None:
        if not self.enabled:
            return
        self.docs += docs
        self.nbytes += nbytes
        if self.bar is not None:
            self.bar.set_postfix(documents=f"{self.docs:,}", refresh=False)
            self.bar.update(nbytes)
            return
        now = time.perf_counter()
        if now - self.last >= 5.0:
            self.last = now
            rate = self.nbytes / max(now - self.t0, 1e-9)
            left = max(self.total - self.nbytes, 0) / max(rate, 1e-9)
            print(f"prepare: {self.docs:,} documents, {self.nbytes / 1e6:,.1f} of "
                  f"{self.total / 1e6:,.1f} MB (rank 0's share), {rate / 1e6:.2f} MB/s, "
                  f"ETA {left:,.0f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _tokenize(units: list[Unit], work: list[tuple[int, int, int]], tok: Tokenizer,
              part: Part, progress: _Progress, *, separator: str | None, text_key: str,
              ) -> tuple[np.ndarray, list[int]]:
    """Tokenize this rank's documents into ``part``'s spill file; its token counts and the
    documents per unit. Not collective."""
    counts = np.zeros(tok.vocab_size, dtype=np.int64)
    per_unit = [0] * len(units)
    docs_t, docs_b = array("q"), array("q")
    state = {"tokens": 0, "bytes": 0}
    eod = [] if tok.eod_id is None else [np.array([tok.eod_id], dtype=np.int64)]
    with open(part.spill, "wb") as spill:
        batch: list[Any] = []
        batch_bytes = 0

        def flush() -> None:
            nonlocal batch, batch_bytes
            if not batch:
                return
            ids = tok.encode_documents([s.text for s in batch])
            pieces = []
            done = 0
            for seg, seg_ids in zip(batch, ids, strict=True):
                pieces.append(seg_ids)
                state["tokens"] += seg_ids.size
                state["bytes"] += seg.nbytes
                if seg.ends:
                    pieces += eod
                    docs_t.append(state["tokens"] + len(eod))
                    docs_b.append(state["bytes"])
                    per_unit[seg.unit] += 1
                    state["tokens"] = state["bytes"] = 0
                    done += 1
            stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
            if stream.size and (stream.min() < 0 or stream.max() >= tok.vocab_size):
                raise ValueError(f"tokenizer {tok.name!r} produced id {int(stream.max())} "
                                 f"outside its vocabulary of {tok.vocab_size}")
            counts[:] += count_ids(stream, tok.vocab_size)
            spill.write(stream.astype(tok.dtype.newbyteorder("<")).tobytes())
            part.n_tokens += stream.size
            progress.update(done, batch_bytes)
            batch, batch_bytes = [], 0

        for seg in read_segments(units, work, separator=_sep(separator), text_key=text_key,
                                 whole_documents=not tok.piecewise):
            batch.append(seg)
            batch_bytes += seg.nbytes
            if batch_bytes >= BATCH_BYTES:
                flush()
        flush()
    part.doc_tokens, part.doc_bytes = list(docs_t), list(docs_b)
    return counts, per_unit


def prepare(inputs: Sequence[str], out: str, tokenizer: str, *, text_key: str = "text",
            separator: str | None = None, overwrite: bool = False, reuse: bool = False,
            progress: bool = False, comm: Any = None) -> dict[str, Any]:
    """Tokenize ``inputs`` into the token file ``out`` (module docstring).

    Collective over ``comm`` (None: one process); every rank passes the same arguments.
    ``reuse``: an existing ``out`` prepared from the same inputs (names, sizes, SHA-256)
    with the same tokenizer, ``text_key`` and ``separator`` is kept as it is (the summary
    says ``reused``); one that differs is replaced with ``overwrite``, else refused.
    Bad input (an input that does not exist, is empty or is not text, a JSON Lines line
    that is not JSON or lacks ``text_key``, a tokenizer that does not load, an existing
    ``out`` without ``overwrite``) raises the same ValueError on every rank and leaves
    nothing behind. Returns the file's summary (counts, tokenizer, content hash, seconds).
    """
    comm = None if comm is None else world(comm)
    size, rank = size_rank(comm)
    t0 = time.perf_counter()
    _check_arguments(inputs, out, tokenizer, text_key, separator, overwrite, reuse)
    units, from_dir = list_units(inputs)
    kind, _ = parse_tokenizer_arg(tokenizer)
    tok = load_tokenizer(tokenizer, single_thread=size > 1) if kind == "file" else None
    units, sums, skipped = _scan_units(units, from_dir, comm)
    if reuse and os.path.exists(out):
        found = _on_root(lambda: _prepared_alike(
            out, units, sums, skipped, tokenizer if tok is None else tok.json,
            text_key=text_key, separator=separator), comm)
        if found["same"]:
            return dict(found["summary"], n_sources=len(units), skipped=len(skipped),
                        ranks=size, seconds=time.perf_counter() - t0, seconds_tokenize=0.0,
                        reused=True)
        if not overwrite:
            raise ValueError(f"--out {out!r} exists and was not prepared from these inputs "
                             f"alike ({found['why']}); give --overwrite to replace it")
    if tok is None:
        tok = _tokenizer(tokenizer, units, separator, text_key, comm)
    directory = os.path.dirname(os.path.abspath(out))
    tmp = bcast_json(os.path.join(directory, f".{os.path.basename(out)}.tmp-"
                                  f"{uuid.uuid4().hex[:12]}") if rank == 0 else None, comm)
    part = Part(spill=f"{tmp}.rank{rank}")
    try:
        return _write(units, sums, skipped, tok, part, tmp, out, comm, t0, text_key=text_key,
                      separator=separator, overwrite=overwrite, progress=progress)
    finally:
        for path in (part.spill, tmp if rank == 0 else None):
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)


def _write(units: list[Unit], sums: list[str], skipped: list[str], tok: Tokenizer,
           part: Part, tmp: str, out: str, comm: Any, t0: float, *, text_key: str,
           separator: str | None, overwrite: bool, progress: bool) -> dict[str, Any]:
    size, rank = size_rank(comm)
    work = work_ranges(units, rank, size, _sep(separator))
    bar = _Progress(sum(hi - lo for _, lo, hi in work), progress and rank == 0)
    error, counts, per_unit = None, np.zeros(0, dtype=np.int64), [0] * len(units)
    t_tok = time.perf_counter()
    try:
        counts, per_unit = _tokenize(units, work, tok, part, bar, separator=separator,
                                     text_key=text_key)
    except (ValueError, OSError) as exc:
        error = str(exc)
    finally:
        bar.close()
    _agree(error, comm)
    seconds_tokenize = time.perf_counter() - t_tok
    mine = np.array([part.n_tokens, len(part.doc_tokens), sum(part.doc_bytes)],
                    dtype=np.int64)
    every = C.allgather(mine, comm=comm).reshape(size, 3)
    n_tokens, n_docs, n_bytes = (int(v) for v in every.sum(axis=0))
    if n_docs == 0:
        raise ValueError("the inputs hold no document (every file or record is empty)")
    C.allreduce(counts, "sum", comm=comm)
    docs = np.array(per_unit, dtype=np.int64)
    C.allreduce(docs, "sum", comm=comm)

    def lay_out() -> dict[str, int]:
        return create_layout(
            tmp, {"n_tokens": np.int64(n_tokens), "n_documents": np.int64(n_docs),
                  "n_bytes": np.int64(n_bytes), "vocab_size": np.int64(tok.vocab_size),
                  "eod_id": np.int64(-1 if tok.eod_id is None else tok.eod_id),
                  "tokenizer_name": tok.name, "text_key": text_key,
                  "separator": separator or ""},
            dtype=tok.dtype, n_tokens=n_tokens, n_documents=n_docs, tokenizer_json=tok.json,
            token_counts=counts,
            sources=[{"name": u.name, "size": u.size, "sha256": s, "documents": int(d)}
                     for u, s, d in zip(units, sums, docs, strict=True)],
            skipped=skipped).as_dict()

    layout = Layout(**_on_root(lay_out, comm))
    error = None
    try:
        write_part(tmp, layout, part, dtype=tok.dtype,
                   first_token=int(every[:rank, 0].sum()),
                   first_document=int(every[:rank, 1].sum()), n_tokens=n_tokens,
                   n_documents=n_docs, last=rank == 0)
    except OSError as exc:
        error = f"{out}: cannot be written: {exc}"
    _agree(error, comm)
    value = _hash_and_commit(tmp, out, layout, tok, n_tokens, n_docs, overwrite, comm)
    return {"out": out, "n_tokens": n_tokens, "n_documents": n_docs, "n_bytes": n_bytes,
            "n_sources": len(units), "skipped": len(skipped), "tokenizer": tok.name,
            "vocab_size": tok.vocab_size, "content_hash": value, "ranks": size,
            "seconds": time.perf_counter() - t0, "seconds_tokenize": seconds_tokenize,
            "reused": False}


def _prepared_alike(out: str, units: list[Unit], sums: list[str], skipped: list[str],
                    tokenizer: str, *, text_key: str, separator: str | None
                    ) -> dict[str, Any]:
    """Whether the token file ``out`` was prepared from ``units`` (names, sizes, SHA-256)
    with ``tokenizer`` (its ``--tokenizer`` value, or a file's JSON), ``text_key`` and
    ``separator``: ``{"same", "why", "summary"}``. Not collective (rank 0)."""
    import h5py

    from mpidist.data.tokenfile import TokenFile

    try:
        tf = TokenFile(out)
        with h5py.File(out, "r") as f:
            src = f["sources"]
            had = [(p.decode() if isinstance(p, bytes) else str(p), int(b),
                    h.decode() if isinstance(h, bytes) else str(h))
                   for p, b, h in zip(src["path"][...], src["bytes"][...],
                                      src["sha256"][...], strict=True)]
            had_skipped = [x.decode() if isinstance(x, bytes) else str(x)
                           for x in f["skipped"][...]]
            options = (f.attrs.get("text_key"), f.attrs.get("separator"))
    except (ValueError, KeyError, OSError) as exc:
        return {"same": False, "why": f"not a readable token file: {exc}"}
    want = [(u.name, u.size, s) for u, s in zip(units, sums, strict=True)]
    named = tf.tokenizer_json if tokenizer.startswith("{") else tf.tokenizer_name
    why = ("other inputs" if had != want or had_skipped != list(skipped) else
           f"tokenizer {tf.tokenizer_name}" if named != tokenizer else
           "other --text-key or --separator" if options != (text_key, separator or "")
           else "")
    return {"same": not why, "why": why, "summary": dict(tf.summary(), out=out)}


def _commit(tmp: str, out: str, overwrite: bool) -> None:
    """Rename ``tmp`` to ``out``; without ``overwrite`` never replace a file that appeared
    meanwhile (a hard link fails if ``out`` exists)."""
    if overwrite:
        os.replace(tmp, out)
        return
    try:
        os.link(tmp, out)
    except FileExistsError:
        raise OSError(f"{out} appeared while it was being prepared") from None
    except OSError:  # no hard links here: the check and the rename are not atomic
        if os.path.exists(out):
            raise OSError(f"{out} appeared while it was being prepared") from None
        os.rename(tmp, out)
        return
    os.remove(tmp)


def _hash_and_commit(tmp: str, out: str, layout: Layout, tok: Tokenizer, n_tokens: int,
                     n_docs: int, overwrite: bool, comm: Any) -> str:
    """Hash the blocks between the ranks; rank 0 writes the hash and renames. Collective."""
    from mpidist.data.tokenfile import HASH_BLOCK_BYTES
    from mpidist.data.tokenwrite import hash_blocks

    size, rank = size_rank(comm)
    n_blocks = -(-n_tokens * tok.dtype.itemsize // HASH_BLOCK_BYTES)
    cuts = split_points(n_blocks, min(size, n_blocks))
    cuts += [n_blocks] * (size + 1 - len(cuts))
    blocks = range(cuts[rank], cuts[rank + 1])
    # a rank with no blocks must not open the file: the allgather does not hold rank 0
    # (which needs nothing from it) until it arrives, and rank 0 then renames the file away
    mine = (hash_blocks(tmp, layout, n_tokens, tok.dtype, blocks) if len(blocks)
            else np.empty(0, dtype=np.uint8))
    digests = np.zeros(n_blocks * 32, dtype=np.uint8)
    digests[cuts[rank] * 32:cuts[rank + 1] * 32] = mine.reshape(-1)
    C.allgather_varied(digests, [32 * (cuts[r + 1] - cuts[r]) for r in range(size)],
                       comm=comm)

    def commit() -> str:
        value = set_content_hash(tmp, layout, digests.reshape(n_blocks, 32), dtype=tok.dtype,
                                 n_tokens=n_tokens, n_documents=n_docs)
        _commit(tmp, out, overwrite)
        return value

    return str(_on_root(commit, comm))
