"""Every data-parallel strategy reproduces single-process training on the same global batch."""

from __future__ import annotations

import numpy as np
import pytest
from strategy_helpers import GPT_CONFIG, make_case, reference_run

from mpidist.core import collectives as C
from mpidist.core.mesh import ProcessMesh
from mpidist.nn import GPT, Linear
from mpidist.optim import Adam
from mpidist.parallel import STRATEGIES, ShardingConfiguration, ZeRO3Optimizer
from mpidist.parallel.registry import DATA_PARALLEL

STEPS = 20
B = 24  # divisible by 1, 2, 3, 4 ranks times 2 micro-batches
# float32: Adam normalises tiny gradients, so round-off moves near-zero weights by ~lr*eps;
# an absolute floor of 1e-5 (weights are ~1e-2) keeps the check meaningful.
TOL = {"float64": dict(rtol=1e-9, atol=1e-12), "float32": dict(rtol=1e-4, atol=1e-5)}


def run_strategy(comm, strategy, kind, dtype, steps=STEPS, micro=1, clip=None, check=None):
    make_model, data, loss, make_opt = make_case(kind)
    mesh = ProcessMesh(comm)
    config = ShardingConfiguration(mesh=mesh, dtype=dtype, micro_batches=micro,
                                   max_grad_norm=clip, bucket_mb=0.002)
    opt = STRATEGIES[strategy](make_opt(), config, loss=loss)
    model = opt.wrap(make_model(), seed=0)
    result = opt.optimize(model, data, steps, global_batch_size=B,
                          callback=(lambda s, l: check(model)) if check else None)
    return result, opt, model


def replicas_identical(model):
    """Replicated parameters must be bit-identical on every rank after each step."""
    if not hasattr(model, "params"):
        return
    mine = model.params
    everyone = C.allgather(mine, comm=model.comm).reshape(model.dp_size, -1)
    assert (everyone == everyone[0]).all(), "replicas diverged"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", DATA_PARALLEL)
@pytest.mark.parametrize("kind", ["gpt", "mlp"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("options", ["plain", "accumulate+clip"])
def test_matches_single_process(comm, strategy, kind, dtype, options):
    micro, clip = (2, 0.05) if options != "plain" else (1, None)
    ref_losses, ref_params = reference_run(kind, STEPS, B, dtype, max_grad_norm=clip)
    result, opt, model = run_strategy(comm, strategy, kind, dtype, micro=micro, clip=clip,
                                      check=replicas_identical)
    np.testing.assert_allclose(result.losses, ref_losses, **TOL[dtype])
    got = model.full_parameters()
    assert sorted(got) == sorted(ref_params)
    for name, ref in ref_params.items():
        np.testing.assert_allclose(got[name], ref, **TOL[dtype], err_msg=name)


def test_single_process_equals_reference():
    from mpi4py import MPI

    for strategy in DATA_PARALLEL:
        ref_losses, _ = reference_run("gpt", 5, B, "float64")
        result, _, _ = run_strategy(MPI.COMM_SELF, strategy, "gpt", "float64", steps=5)
        np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-12)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", DATA_PARALLEL)
def test_serialize_round_trip_continues_the_trajectory(comm, strategy):
    full, _, full_model = run_strategy(comm, strategy, "gpt", "float64", steps=12)
    first, opt, _ = run_strategy(comm, strategy, "gpt", "float64", steps=6)
    blob = opt.serialize()
    # A fresh optimizer and model take the bytes and go on.
    _, data, loss, make_opt = make_case("gpt")
    fresh = STRATEGIES[strategy](make_opt(), opt.config, loss=loss)
    model = fresh.wrap(GPT(GPT_CONFIG), seed=123)  # different init: must be overwritten
    fresh.deserialize(blob)
    rest = fresh.optimize(model, data, 6, global_batch_size=B)
    np.testing.assert_allclose(first.losses + rest.losses, full.losses, rtol=1e-12)
    want = full_model.full_parameters()
    for name, arr in model.full_parameters().items():
        np.testing.assert_allclose(arr, want[name], rtol=1e-12, atol=1e-15)


@pytest.mark.mpi(min_size=2)
def test_state_dict_moves_between_strategies(comm):
    """A DDP state dict loaded into ZeRO-3 (and back) continues the same trajectory."""
    full, _, _ = run_strategy(comm, "ddp", "gpt", "float64", steps=10)
    first, ddp, _ = run_strategy(comm, "ddp", "gpt", "float64", steps=5)
    state = ddp.state_dict()
    _, data, loss, make_opt = make_case("gpt")
    z3 = ZeRO3Optimizer(make_opt(), ddp.config, loss=loss)
    model = z3.wrap(GPT(GPT_CONFIG), seed=7)
    z3.load_state_dict(state)
    rest = z3.optimize(model, data, 5, global_batch_size=B)
    np.testing.assert_allclose(first.losses + rest.losses, full.losses, rtol=1e-10)


@pytest.mark.mpi(min_size=2)
def test_deserialize_refuses_other_strategy_and_model(comm):
    _, ddp, _ = run_strategy(comm, "ddp", "gpt", "float64", steps=1)
    blob = ddp.serialize()
    _, z1, _ = run_strategy(comm, "zero1", "gpt", "float64", steps=1)
    with pytest.raises(ValueError, match="strategy 'ddp', not 'zero1'"):
        z1.deserialize(blob)
    _, mlp_opt, _ = run_strategy(comm, "ddp", "mlp", "float64", steps=1)
    with pytest.raises(ValueError, match="another model"):
        mlp_opt.deserialize(blob)
    with pytest.raises(ValueError, match="bad magic"):
        ddp.deserialize(b"not a state")
    import json
    import struct

    from mpidist.parallel.serialization import MAGIC

    (hlen,) = struct.unpack_from("<Q", blob, len(MAGIC))
    start = len(MAGIC) + 8
    header = json.loads(blob[start:start + hlen])
    header["version"] = 99
    head = json.dumps(header).encode()
    bumped = MAGIC + struct.pack("<Q", len(head)) + head + blob[start + hlen:]
    with pytest.raises(ValueError, match="version 99"):
        ddp.deserialize(bumped)


@pytest.mark.mpi(min_size=2)
def test_bad_input_raises_on_every_rank(comm):
    mesh = ProcessMesh(comm)
    with pytest.raises(ValueError, match="ZeRO-3 needs a model made of units"):
        ZeRO3Optimizer(Adam(), ShardingConfiguration(mesh=mesh)).wrap(Linear(4, 3))
    with pytest.raises(ValueError, match="bucket_mb=0"):
        ShardingConfiguration(mesh=mesh, bucket_mb=0)
    with pytest.raises(ValueError, match="unknown field bucket_size=3"):
        ShardingConfiguration(bucket_size=3)
    _, data, loss, make_opt = make_case("mlp")
    opt = STRATEGIES["ddp"](make_opt(), ShardingConfiguration(mesh=mesh, micro_batches=4),
                            loss=loss)
    model = opt.wrap(make_case("mlp")[0]())
    # 6 samples split into 2+2+1+1; one rank with 3 cannot fill 4 micro-batches
    x, y = data.batch(np.arange(3 if comm.Get_rank() == 1 else 6))
    with pytest.raises(ValueError, match="data-parallel rank 1 has a local batch of 3 samples, "
                                         "fewer than micro_batches=4"):
        opt.step(model, (x, y))
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_overlap_off_gives_the_same_result(comm):
    ref, _, _ = run_strategy(comm, "ddp", "gpt", "float64", steps=4)
    _, data, loss, make_opt = make_case("gpt")
    cfg = ShardingConfiguration(mesh=ProcessMesh(comm), dtype="float64", overlap=False)
    opt = STRATEGIES["ddp"](make_opt(), cfg, loss=loss)
    model = opt.wrap(GPT(GPT_CONFIG))
    res = opt.optimize(model, data, 4, global_batch_size=B)
    np.testing.assert_allclose(res.losses, ref.losses, rtol=1e-12)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_tied_embeddings_match_single_process(comm, strategy):
    """The head reads the token embedding (tie_weights): both uses add into one gradient."""
    from mpi4py import MPI

    from mpidist.nn import GPTConfig

    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=16,
                    tie_weights=True)
    _, data, loss, make_opt = make_case("gpt")
    losses = []
    for c in (MPI.COMM_SELF, comm):
        opt = STRATEGIES[strategy](make_opt(), ShardingConfiguration(
            mesh=ProcessMesh(c), dtype="float64"), loss=loss)
        model = opt.wrap(GPT(cfg), seed=0)
        losses.append(opt.optimize(model, data, 5, global_batch_size=B).losses)
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-10)
    for name in ("zero2", "zero3"):
        with pytest.raises(ValueError, match="tied weights"):
            STRATEGIES[name](make_opt(), ShardingConfiguration(mesh=ProcessMesh(comm))).wrap(
                GPT(cfg))
    comm.Barrier()
