"""Test-side writers of the token files other tools make, following each published format
byte for byte (independent of mpidist's readers), and a small corpus."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np

# megatron/core/datasets/indexed_dataset.py (megatron-core 0.16): DType codes
MEGATRON_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5,
                  np.float64: 6, np.float32: 7, np.uint16: 8}


def write_megatron(prefix: Path, documents: list[list[np.ndarray]], dtype=np.uint16) -> None:
    """What megatron-core's IndexedDatasetBuilder writes for ``documents`` (each a list of
    sequences): ``add_item`` for every sequence, ``end_document`` after each document,
    ``finalize``. The .bin holds the sequences back to back; the .idx: the 9-byte header,
    version 1 (<Q), the dtype code (<B), the sequence count (<Q), the document-index count
    (<Q), int32 lengths, int64 byte pointers, int64 document indices starting at 0."""
    lengths, doc_idx = [], [0]
    with open(f"{prefix}.bin", "wb") as data:
        for doc in documents:
            for seq in doc:
                arr = np.array(seq, dtype=dtype)
                data.write(arr.tobytes(order="C"))
                lengths.append(arr.size)
            doc_idx.append(len(lengths))
    itemsize = np.dtype(dtype).itemsize
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * itemsize
    with open(f"{prefix}.idx", "wb") as idx:
        idx.write(b"MMIDIDX\x00\x00")
        idx.write(struct.pack("<Q", 1))
        idx.write(struct.pack("<B", MEGATRON_CODES[dtype]))
        idx.write(struct.pack("<Q", len(lengths)))
        idx.write(struct.pack("<Q", len(doc_idx)))
        idx.write(np.array(lengths, dtype=np.int32).tobytes(order="C"))
        idx.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
        idx.write(np.array(doc_idx, dtype=np.int64).tobytes(order="C"))


def write_nanogpt(path: Path, ids: np.ndarray) -> None:
    """What nanoGPT's data/*/prepare.py writes: the ids as a raw np.uint16 array (its
    np.memmap(filename, dtype=np.uint16, mode='w+') then arr[...] = ids)."""
    arr = np.memmap(path, dtype=np.uint16, mode="w+", shape=(len(ids),))
    arr[:] = np.asarray(ids, dtype=np.uint16)
    arr.flush()
    del arr


TEXTS = [
    "def main(argv):\n    return 0\n\nclass Foo:\n    pass\n",
    "Naïve café — 東京 ✓\n\ttabs\r\nand CRLF, numbers 12345 678\n\n\nend.\n",
    "x = [1, 2, 3]  # ×2\nprint('héllo')\n" * 40,
    "plain words and more words; punctuation!? (yes) [no] {maybe}\n" * 25,
    "<|endoftext|> appears literally in this text\n",
    "a" * 3000 + "\n" + "b1\n" * 700,
]


def write_corpus(root: Path) -> dict[str, list[str]]:
    """A corpus of every input kind; the documents of each input in order."""
    root.mkdir(parents=True, exist_ok=True)
    docs: dict[str, list[str]] = {}
    (root / "one.txt").write_text(TEXTS[0] + TEXTS[1], encoding="utf-8")
    docs["one.txt"] = [TEXTS[0] + TEXTS[1]]
    with open(root / "recs.jsonl", "w", encoding="utf-8") as f:
        for t in TEXTS:
            f.write(json.dumps({"text": t, "id": 1}) + "\n")
        f.write("\n")  # a blank line is no document
    docs["recs.jsonl"] = list(TEXTS)
    with gzip.open(root / "more.jsonl.gz", "wt", encoding="utf-8") as f:
        for t in reversed(TEXTS):
            f.write(json.dumps({"text": t}) + "\n")
    docs["more.jsonl.gz"] = list(reversed(TEXTS))
    with gzip.open(root / "zipped.txt.gz", "wt", encoding="utf-8") as f:
        f.write(TEXTS[3])
    docs["zipped.txt.gz"] = [TEXTS[3]]
    return docs


def train_alone(config, train, batch: int, steps: int, valid=None, eval_batches: int = 2):
    """Single-process training of ``GPT(config)`` on ``train`` (float64, AdamW, the
    sampler of seed 5): (losses, final parameters by name, the mean loss of
    ``eval_batches`` evaluation batches of ``valid`` (seed 7), or None without it)."""
    from mpidist.nn import GPT, CrossEntropyLoss
    from mpidist.optim import AdamW

    model = GPT(config)
    params, grads = model.build(np.dtype("float64"), seed=0)
    opt = AdamW(lr=3e-3, weight_decay=0.1)
    state = opt.init_state(params.data.shape[0], dtype=np.dtype("float64"))
    loss = CrossEntropyLoss()
    sampler = train.sampler(batch, seed=5)
    losses = []
    for step in range(steps):
        x, y = train.batch(sampler.global_indices(step))
        grads.zero_()
        losses.append(loss.forward(model.forward(x), y))
        model.backward(loss.backward())
        opt.update(params.data, grads.data, state)
    val = None
    if valid is not None:
        evaluator = valid.eval_sampler(batch, seed=7)
        val = 0.0
        for step in range(eval_batches):
            x, y = valid.batch(evaluator.global_indices(step))
            val += loss.forward(model.forward(x), y) / eval_batches
    return losses, {n: v.copy() for n, v in params.views().items()}, val
