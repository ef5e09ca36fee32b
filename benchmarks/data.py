"""Data at any size: `mpidist prepare` against the tokenizer library, and training start time
and memory that do not grow with the data.

    python benchmarks/data.py [--text-mb 256] [--big-gib 10] [--text-gib 1] [--ranks 2]
        [--dir DIR] [--only prepare,tokens,text,blend] [--smallest] [--json FILE]

* prepare: ``--text-mb`` of text (the standard library's sources as JSON Lines documents)
  through ``mpiexec -n 1`` and ``-n 2 mpidist prepare`` end to end (launch, tokenization,
  the token file written, hashed and renamed) against HF ``tokenizers``' own
  ``encode_batch`` of the same documents, already in memory, with the library's threads on
  every core: MB/s and the ratio (goal >= 0.8 at 2 ranks); also against its
  ``encode_batch_fast`` (no offsets: what prepare calls, the library's fastest). The
  tokenizer is one byte-level BPE of 4096 tokens trained once on a sample and given to
  both as a file.
* tokens: ``mpidist train`` at ``--ranks`` on a synthetic token file of ``--big-gib`` GiB
  against one of 10 MiB, alternating: the time from launch to the first training step
  (goal: within 1.1x) and each rank's anonymous memory (RssAnon from /proc/self/status:
  mapped file pages are the page cache's; goal: within +64 MiB), and the time the ranks
  spend making batches as a fraction of the step (goal: < 2%) with the GPT of
  :data:`GPT_4X128` (4 x 128, global batch 32 x 64 tokens: the model of `make run`'s
  first versions, kept so that the figures stay comparable).
* text: the same for ``--text-gib`` GiB of plain text against 10 MiB, first with an empty
  data cache (the text is checked and hashed once), then with the cache the first run left.

* blend: the same training probe on a blend of three token files (weights 0.5, 0.3, 0.2)
  against one of them alone, alternating: the time the ranks spend drawing each step's
  samples (the sources by the weights, the windows per source) and reading them, as a
  fraction of the step, and the blend's against the one file's (goal: < 2% of the step).

``--smallest`` runs every part at a tiny size (as ``make test`` does) to check the script.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

#: The GPT of the training probes: 4 x 128, global batch 32 x 64 tokens (TrainConfig's
#: defaults; `make run`'s model while it trained on bytes), named so that its figures stay
#: comparable whatever `make run` trains.
GPT_4X128 = ["--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--block-size", "64",
             "--global-batch", "32"]


def _env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1",
             NUMBA_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    e["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                       e.get("PYTHONPATH", "")])
    e.update(extra)
    return e


# -- the corpus and the tokenizer -----------------------------------------------------------
def make_corpus(path: Path, size: int) -> int:
    """JSON Lines of the standard library's sources, cycled up to ``size`` bytes of text."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"),
                             recursive=True))
    done = 0
    with open(path, "w", encoding="utf-8") as out:
        while done < size:
            for name in files:
                try:
                    text = Path(name).read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                text = text[: size - done]
                if not text:
                    continue
                out.write(json.dumps({"text": text}) + "\n")
                done += len(text.encode())
                if done >= size:
                    break
    return done


def make_tokenizer(corpus: Path, path: Path, vocab: int = 4096) -> None:
    from mpidist.data.tokenizer import train_bpe

    texts, taken = [], 0
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            taken += len(texts[-1])
            if taken > 8 << 20:
                break
    path.write_text(train_bpe(texts, vocab).json, encoding="utf-8")


def peer(corpus: str, tokenizer: str) -> None:
    """HF tokenizers on the corpus in memory, its threads on every core: ``encode_batch``
    and ``encode_batch_fast`` (no offsets; what mpidist prepare calls), 512 documents a
    call."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(tokenizer)
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    nbytes = sum(len(t.encode()) for t in texts)
    out = {"bytes": nbytes}
    for name in ("encode_batch", "encode_batch_fast"):
        encode = getattr(tok, name)
        t0 = time.perf_counter()
        for i in range(0, len(texts), 512):
            encode(texts[i:i + 512], add_special_tokens=False)
        out[name] = time.perf_counter() - t0
    print(json.dumps(out))


def bench_prepare(work: Path, size: int, rounds: int) -> dict:
    corpus, tok = work / "corpus.jsonl", work / "tokenizer.json"
    nbytes = make_corpus(corpus, size)
    make_tokenizer(corpus, tok)
    env = {k: v for k, v in _env().items() if k != "RAYON_NUM_THREADS"}
    best: dict[str, float] = {}
    for _ in range(rounds):
        out = subprocess.run([sys.executable, __file__, "peer", str(corpus), str(tok)],
                             env=env, capture_output=True, text=True, check=True)
        for name, seconds in json.loads(out.stdout).items():
            if name != "bytes":
                best[name] = min(best.get(name, 1e30), seconds)
        for n in (1, 2):
            t0 = time.perf_counter()
            subprocess.run(["mpiexec", "-n", str(n), sys.executable, "-m", "mpidist.cli",
                            "prepare", str(corpus), "--out", str(work / "p.h5"),
                            "--tokenizer", str(tok), "--overwrite", "--no-progress"],
                           env=env, check=True, capture_output=True)
            key = f"prepare_{n}"
            best[key] = min(best.get(key, 1e30), time.perf_counter() - t0)
    mbs = {k: nbytes / 1e6 / v for k, v in best.items()}
    print(f"prepare {nbytes / 2**20:.0f} MiB of JSON Lines text, byte-level BPE 4096:")
    for name in ("encode_batch", "encode_batch_fast"):
        print(f"  HF {name} (threads on {os.cpu_count()} cores), in memory: "
              f"{mbs[name]:.2f} MB/s")
    for n in (1, 2):
        mine = mbs[f"prepare_{n}"]
        print(f"  mpidist prepare -n {n}, end to end with the write: {mine:.2f} MB/s = "
              f"{mine / mbs['encode_batch']:.2f}x encode_batch, "
              f"{mine / mbs['encode_batch_fast']:.2f}x encode_batch_fast")
    return {"bytes": nbytes, "seconds": best, "mb_per_s": mbs}


# -- token files and training start ---------------------------------------------------------
def synthetic_token_file(path: Path, n_tokens: int, seed: int = 0) -> None:
    """A token file of ``n_tokens`` random byte ids (the bytes tokenizer's vocabulary) in
    documents of about 2000 tokens, written through mpidist's own writer."""
    from mpidist.data.tokenfile import HASH_BLOCK_BYTES
    from mpidist.data.tokenizer import load_tokenizer
    from mpidist.data.tokenwrite import create_layout, hash_blocks, set_content_hash

    tok = load_tokenizer("bytes")
    docs = np.arange(0, n_tokens, 2000, dtype=np.int64)
    rng = np.random.default_rng(seed)
    counts = np.zeros(tok.vocab_size, dtype=np.int64)
    tmp = str(path) + ".tmp"
    layout = create_layout(tmp, {"n_tokens": np.int64(n_tokens),
                                 "n_documents": np.int64(docs.size),
                                 "n_bytes": np.int64(n_tokens), "vocab_size": np.int64(257),
                                 "eod_id": np.int64(256), "tokenizer_name": "bytes"},
                           dtype=tok.dtype, n_tokens=n_tokens, n_documents=int(docs.size),
                           tokenizer_json=tok.json, token_counts=counts, sources=[],
                           skipped=[])
    fd = os.open(tmp, os.O_WRONLY)
    try:
        step = 1 << 26
        for a in range(0, n_tokens, step):
            ids = rng.integers(0, 257, size=min(step, n_tokens - a), dtype=np.uint16)
            counts += np.bincount(ids, minlength=257)
            os.pwrite(fd, ids.astype("<u2").tobytes(), layout.tokens + 2 * a)
        offsets = np.append(docs, n_tokens).astype("<i8")
        os.pwrite(fd, offsets.tobytes(), layout.document_offsets)
        os.pwrite(fd, np.diff(offsets).astype("<i8").tobytes(), layout.document_bytes)
    finally:
        os.close(fd)
    import h5py

    with h5py.File(tmp, "r+") as f:  # the counts are not part of the content hash
        f["token_counts"][...] = counts
    n_blocks = -(-2 * n_tokens // HASH_BLOCK_BYTES)
    digests = hash_blocks(tmp, layout, n_tokens, tok.dtype, range(n_blocks))
    set_content_hash(tmp, layout, digests, dtype=tok.dtype, n_tokens=n_tokens,
                     n_documents=int(docs.size))
    os.replace(tmp, path)


PROBE = """
import json, os, sys, time
import mpidist.run.loop as loop
from mpi4py import MPI
from mpidist.run import TrainConfig, run_training

def rss():
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('RssAnon:'):
                return int(line.split()[1]) * 1024
rec = {'data': 0.0, 'batches': 0}
make = loop.make_data
def make_data(cfg, comm=None):
    train, val = make(cfg, comm)
    rec['rss_after_data'] = rss()
    batch, sampler = train.batch, train.sampler
    def timed(idx):
        t = time.perf_counter(); out = batch(idx); rec['data'] += time.perf_counter() - t
        rec['batches'] += 1
        return out
    def timed_sampler(*args, **kwargs):
        s = sampler(*args, **kwargs)
        draw = s.next_local
        def next_local(*a, **k):
            t = time.perf_counter(); out = draw(*a, **k); rec['data'] += time.perf_counter() - t
            return out
        s.next_local = next_local
        return s
    train.batch, train.sampler = timed, timed_sampler
    return train, val
loop.make_data = make_data
args = json.loads(sys.argv[1])
run_training(TrainConfig(**args), MPI.COMM_WORLD)
rec['rss_end'] = rss()
rows = MPI.COMM_WORLD.gather(rec, root=0)
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps(rows))
"""


def train_probe(data: Path | list, out: Path, ranks: int, steps: int, env: dict) -> dict:
    """Launch training (``data``: a file, or a blend's ``[[weight, path], ...]``); the time
    to its first step and each rank's memory and data time (drawing and reading)."""
    cfg = {"out": str(out), "steps": steps, "eval_interval": 0,
           "checkpoint_interval": 0, "progress": False, "overwrite": True}
    if isinstance(data, list):
        cfg["data_blend"] = data
    else:
        cfg["data"] = str(data)
    for flag, value in zip(GPT_4X128[::2], GPT_4X128[1::2], strict=True):
        cfg[flag[2:].replace("-", "_")] = int(value)
    t0 = time.time()
    proc = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, "-c", PROBE,
                           json.dumps(cfg)], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    ranks_rec = json.loads(proc.stdout.strip().splitlines()[-1])
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    start = next(e["time"] for e in events if e["event"] == "start")
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    step_s = [m["seconds"] for m in metrics if m.get("split") == "train"]
    first = start - t0 + step_s[0]
    steady = float(np.median(step_s[2:] if len(step_s) > 3 else step_s))
    data_s = max(r["data"] / max(r["batches"], 1) for r in ranks_rec)
    return {"first_step_s": first, "step_s": steady, "data_per_step_s": data_s,
            "rss_anon_mib": [r["rss_end"] / 2**20 for r in ranks_rec],
            "rss_after_data_mib": [r["rss_after_data"] / 2**20 for r in ranks_rec]}


def _compare(name: str, small: list[dict], big: list[dict]) -> None:
    """Print big against small: the median first-step time of the rounds (and the best),
    the largest RssAnon of a rank, the data time per step."""
    def med(rows: list[dict], key: str) -> float:
        return float(np.median([r[key] for r in rows]))

    fs, fb = med(small, "first_step_s"), med(big, "first_step_s")
    bs = min(r["first_step_s"] for r in small)
    bb = min(r["first_step_s"] for r in big)
    rs = max(max(r["rss_anon_mib"]) for r in small)
    rb = max(max(r["rss_anon_mib"]) for r in big)
    data, step = med(big, "data_per_step_s"), med(big, "step_s")
    print(f"  {name}: first step after {fb:.2f} s against {fs:.2f} s = {fb / fs:.2f}x (median "
          f"of {len(big)}; best {bb:.2f} / {bs:.2f} = {bb / bs:.2f}x); RssAnon per rank "
          f"{rb:.0f} against {rs:.0f} MiB = {rb - rs:+.1f} MiB; data {1e3 * data:.2f} ms of a "
          f"{1e3 * step:.0f} ms step = {100 * data / step:.2f}%")


def bench_start(work: Path, kind: str, big_bytes: int, ranks: int, rounds: int,
                steps: int) -> dict:
    small_bytes = 10 << 20
    paths = {}
    for label, size in (("small", small_bytes), ("big", big_bytes)):
        if kind == "tokens":
            paths[label] = work / f"{label}.h5"
            synthetic_token_file(paths[label], size // 2, seed=len(label))
        else:
            paths[label] = work / f"{label}.txt"
            make_text(paths[label], size)
    results: dict[str, list[dict]] = {"small": [], "big": []}
    caches = {label: work / f"cache-{label}" for label in paths}
    for r in range(rounds):
        for label in ("small", "big"):
            if kind == "text" and r == 0:
                shutil.rmtree(caches[label], ignore_errors=True)  # the first start: cold
            env = _env(MPIDIST_CACHE_DIR=str(caches[label]))
            results[label].append(train_probe(paths[label], work / f"run-{label}", ranks,
                                              steps, env))
    print(f"{kind}: {big_bytes / 2**30:.2f} GiB against 10 MiB, mpidist train at {ranks} "
          f"ranks, GPT_4X128:")
    if kind == "text":
        _compare("first start (data cache empty)", results["small"][:1], results["big"][:1])
        _compare("started again", results["small"][1:], results["big"][1:])
    else:
        _compare("started", results["small"], results["big"])
    for label in paths:
        os.remove(paths[label])
    return {"big_bytes": big_bytes, "rounds": results}


def bench_blend(work: Path, size: int, ranks: int, rounds: int, steps: int) -> dict:
    """Data time per step of a blend of three token files against one of them alone."""
    files = [work / f"source{i}.h5" for i in range(3)]
    for i, path in enumerate(files):
        synthetic_token_file(path, size // 2, seed=10 + i)
    blend = [[0.5, str(files[0])], [0.3, str(files[1])], [0.2, str(files[2])]]
    results: dict[str, list[dict]] = {"one": [], "blend": []}
    for _ in range(rounds):
        for label, data in (("one", files[0]), ("blend", blend)):
            results[label].append(train_probe(data, work / f"run-{label}", ranks, steps,
                                              _env()))

    def med(label: str, key: str) -> float:
        return float(np.median([r[key] for r in results[label]]))

    print(f"blend: data time (drawing the samples and reading them) per step of a blend of 3 "
          f"token files of {size / 2**20:.0f} MiB against one alone, mpidist train at "
          f"{ranks} ranks, GPT_4X128 (median of {rounds}):")
    for label, name in (("one", "one file"), ("blend", "blend of 3")):
        data, step = med(label, "data_per_step_s"), med(label, "step_s")
        print(f"  {name}: {1e3 * data:.3f} ms of a {1e3 * step:.0f} ms step = "
              f"{100 * data / step:.2f}%")
    ratio = med("blend", "data_per_step_s") / med("one", "data_per_step_s")
    print(f"  blend / one file: {ratio:.2f}x the data time")
    for path in files:
        os.remove(path)
    return {"size": size, "rounds": results}


def make_text(path: Path, size: int) -> None:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    blob = b"\n".join(Path(f).read_bytes() for f in files)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            f.write(blob[:left])
            left -= min(left, len(blob))


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's mpidist
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        peer(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text-mb", type=float, default=256)
    ap.add_argument("--big-gib", type=float, default=10)
    ap.add_argument("--text-gib", type=float, default=1)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="training steps of each start")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--only", default="prepare,tokens,text,blend")
    ap.add_argument("--blend-mib", type=float, default=64, help="size of each blend source")
    ap.add_argument("--smallest", action="store_true", help="every part at a tiny size")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.smallest:
        args.text_mb, args.big_gib, args.text_gib, args.rounds = 0.25, 0.02, 0.02, 1
        args.blend_mib = 1
        args.steps = 3
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().split()[0]}")
    work = Path(tempfile.mkdtemp(prefix="mpidist-bench-data-", dir=args.dir))
    report: dict = {}
    try:
        parts = args.only.split(",")
        if "prepare" in parts:
            report["prepare"] = bench_prepare(work, int(args.text_mb * 2**20), args.rounds)
        if "tokens" in parts:
            report["tokens"] = bench_start(work, "tokens", int(args.big_gib * 2**30),
                                           args.ranks, args.rounds, args.steps)
        if "text" in parts:
            report["text"] = bench_start(work, "text", int(args.text_gib * 2**30), args.ranks,
                                         max(2, args.rounds), args.steps)
        if "blend" in parts:
            report["blend"] = bench_blend(work, int(args.blend_mib * 2**20), args.ranks,
                                          args.rounds, args.steps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open("/proc/loadavg") as f:
        print(f"load average after: {f.read().split()[0]}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
