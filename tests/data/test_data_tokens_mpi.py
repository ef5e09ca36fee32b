"""Token files under MPI: `prepare` writes the same bytes at every world size, and training
on a token file reproduces single-process training (float64) at every world size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from token_helpers import TEXTS, train_alone, write_corpus

from mpidist.core.comms import bcast_json
from mpidist.core.mesh import ProcessMesh
from mpidist.data.prepare import prepare
from mpidist.data.tokens import describe_data, open_token_data
from mpidist.nn import GPT, CrossEntropyLoss, GPTConfig
from mpidist.optim import AdamW
from mpidist.parallel import STRATEGIES, ShardingConfiguration

B, T, STEPS = 12, 8, 6


def _shared_dir(comm, tmp_path: Path) -> Path:
    return Path(bcast_json(str(tmp_path), comm))


def _inputs(root: Path) -> list[str]:
    """Inputs the ranks split inside files: a JSON Lines file of many records and a text
    file of documents separated by blank lines, with runs of newlines longer than the
    separator (the cuts must find the same documents from any byte)."""
    write_corpus(root / "corpus")
    rng = np.random.default_rng(3)
    with open(root / "many.jsonl", "w", encoding="utf-8") as f:
        for i in range(300):
            f.write(json.dumps({"text": TEXTS[i % len(TEXTS)][: 40 + 7 * (i % 13)]}) + "\n")
    parts = []
    for i in range(400):
        parts.append(TEXTS[i % len(TEXTS)][: 5 + (i * 11) % 90])
        parts.append("\n" * int(rng.integers(2, 7)))
    (root / "blank.txt").write_text("".join(parts), encoding="utf-8")
    return [str(root / "corpus"), str(root / "many.jsonl"), str(root / "blank.txt")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_prepare_is_byte_identical_at_any_world_size(comm, tmp_path, tokenizer):
    root = _shared_dir(comm, tmp_path)
    if comm.Get_rank() == 0:
        inputs = _inputs(root)
        alone = prepare(inputs, str(root / "one.h5"), tokenizer, separator="\n\n")
    comm.Barrier()
    inputs = bcast_json(inputs if comm.Get_rank() == 0 else None, comm)
    together = prepare(inputs, str(root / "many.h5"), tokenizer, separator="\n\n", comm=comm)
    if comm.Get_rank() == 0:
        assert together["content_hash"] == alone["content_hash"]
        assert together["n_documents"] == alone["n_documents"] > 700
        assert (root / "many.h5").read_bytes() == (root / "one.h5").read_bytes()


def _token_data(comm, tmp_path: Path):
    root = _shared_dir(comm, tmp_path)
    if comm is None or comm.Get_rank() == 0:
        (root / "text.txt").write_text("".join(TEXTS) * 3, encoding="utf-8")
    if comm is not None:
        comm.Barrier()
    path = root / "data.h5"
    prepare([str(root / "text.txt")], str(path), "bytes", comm=comm)
    train, _ = open_token_data(describe_data(str(path)), T)
    return train


GPT_CONFIG = GPTConfig(vocab_size=257, block_size=T, n_layer=1, n_head=2, n_embd=16)


def _alone(train) -> tuple[list[float], dict[str, np.ndarray]]:
    return train_alone(GPT_CONFIG, train, B, STEPS)[:2]


def _distributed(comm, train, strategy: str):
    config = ShardingConfiguration(mesh=ProcessMesh(comm), dtype="float64", bucket_mb=0.002)
    opt = STRATEGIES[strategy](AdamW(lr=3e-3, weight_decay=0.1), config,
                               loss=CrossEntropyLoss())
    model = opt.wrap(GPT(GPT_CONFIG), seed=0)
    result = opt.optimize(model, train, STEPS, global_batch_size=B,
                          sampler=train.sampler(B, seed=5))
    return result.losses, model.full_parameters()


def _same(got, want) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=1e-9, atol=1e-12)
    for name, ref in want[1].items():
        np.testing.assert_allclose(got[1][name], ref, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_training_on_a_token_file_matches_single_process(comm, tmp_path, strategy):
    train = _token_data(comm, tmp_path)
    _same(_distributed(comm, train, strategy), _alone(train))


def test_one_process_matches_the_reference(tmp_path):
    from mpi4py import MPI

    train = _token_data(None, tmp_path)
    _same(_distributed(MPI.COMM_SELF, train, "ddp"), _alone(train))
