"""A blend under MPI: training on a blend of an mpidist token file, a Megatron file and a
nanoGPT file reproduces single-process training (float64) at every world size, and so
does its validation loss (each evaluation batch drawn from the sources in proportion)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from token_helpers import TEXTS, train_alone, write_megatron, write_nanogpt

from mpidist.core.comms import bcast_json
from mpidist.core.mesh import ProcessMesh
from mpidist.data.blend import open_blend
from mpidist.data.prepare import prepare
from mpidist.nn import GPT, CrossEntropyLoss, GPTConfig
from mpidist.optim import AdamW
from mpidist.parallel import STRATEGIES, ShardingConfiguration

B, T, STEPS = 13, 8, 6
GPT_CONFIG = GPTConfig(vocab_size=257, block_size=T, n_layer=1, n_head=2, n_embd=16)


def _blend(comm, tmp_path: Path):
    root = Path(bcast_json(str(tmp_path), comm) if comm is not None else str(tmp_path))
    if comm is None or comm.Get_rank() == 0:
        (root / "text.txt").write_text("".join(TEXTS) * 2, encoding="utf-8")
        ids = np.frombuffer("".join(reversed(TEXTS)).encode(), dtype=np.uint8)
        write_megatron(root / "meg", [[ids[i:i + 700]] for i in range(0, ids.size, 700)])
        write_nanogpt(root / "train.bin", ids[::-1].astype(np.uint16))
    if comm is not None:
        comm.Barrier()
    prepare([str(root / "text.txt")], str(root / "data.h5"), "bytes", comm=comm)
    sources = [[0.5, str(root / "data.h5")], [0.3, str(root / "meg")],
               [0.2, str(root / "train.bin")]]
    return open_blend(sources, T, comm=comm)


def _alone(train, valid) -> tuple[list[float], dict[str, np.ndarray], float]:
    return train_alone(GPT_CONFIG, train, B, STEPS, valid)


def _distributed(comm, train, valid, strategy: str):
    config = ShardingConfiguration(mesh=ProcessMesh(comm), dtype="float64", bucket_mb=0.002)
    opt = STRATEGIES[strategy](AdamW(lr=3e-3, weight_decay=0.1), config,
                               loss=CrossEntropyLoss())
    model = opt.wrap(GPT(GPT_CONFIG), seed=0)
    result = opt.optimize(model, train, STEPS, global_batch_size=B,
                          sampler=train.sampler(B, seed=5))
    val = opt.evaluate(model, valid, batches=2, global_batch_size=B, seed=7)
    return result.losses, model.full_parameters(), val


def _same(got, want) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=1e-9, atol=1e-12)
    for name, ref in want[1].items():
        np.testing.assert_allclose(got[1][name], ref, rtol=1e-9, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-9, atol=1e-12)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_blend_trains_as_one_process_does_at_every_world_size(comm, tmp_path, strategy):
    train, valid = _blend(comm, tmp_path)
    assert [s["kind"] for s in train.identity()["sources"]] == ["tokens", "megatron",
                                                                "nanogpt"]
    _same(_distributed(comm, train, valid, strategy), _alone(train, valid))


def test_one_process_matches_the_reference(tmp_path):
    from mpi4py import MPI

    train, valid = _blend(None, tmp_path)
    _same(_distributed(MPI.COMM_SELF, train, valid, "ddp"), _alone(train, valid))
