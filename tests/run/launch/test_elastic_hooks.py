"""Elastic resizing with gradient-communication hooks and on a hybrid mesh, end to end.

Each run is ``tests/run/launch/elastic_worker.py`` under mpiexec (2 workers, a join to 3 after
step 2, old rank 0 leaving after step 5), compared with what the hook's resize semantics
say it must be:

* Local SGD: at a resize the replicas are averaged (parameters and optimizer state,
  weighted by their share of the last batch) and every new replica starts from that
  average; the period's phase carries on. Simulated here replica by replica in one process.
* async SGD: the in-flight gradients are applied at the resize. Simulated here.
* top-k compression: the error-feedback residuals restart at zero (the event records the
  norm dropped); the run goes on.
* a hybrid mesh (pp=2): dp 1 -> 2 -> 1 equals the uninterrupted fixed-size hybrid run.
"""

from __future__ import annotations

import json
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from test_elastic_jobs import HERE, MPIEXEC, _env, _mpiexec, _run, _worker_args, check_final, events

from mpidist.optim import SGD
from mpidist.parallel import ShardingConfiguration
from mpidist.parallel.elastic import ElasticOptimizer
from mpidist.parallel.hooks import LocalSGD

pytestmark = [pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH"),
              pytest.mark.timeout(120)]

STEPS = 8
ACTIONS = "2:scale=3,5:leave@0"  # 2 -> 3 workers after step 2, 3 -> 2 after step 5
RESIZES = {2, 5}


def _size(step: int) -> int:
    return 3 if 3 <= step <= 5 else 2


def _worker_module():
    sys.path.insert(0, str(HERE))
    try:
        import elastic_worker as w
    finally:
        sys.path.remove(str(HERE))
    return w


def _setup():
    from mpidist.data import GlobalBatchSampler
    from mpidist.nn import MLP, MSELoss

    w = _worker_module()
    model, opt = MLP(w.SIZES), w.make_base()
    params, grads = model.build(np.dtype("float64"), seed=0)
    sampler = GlobalBatchSampler(len(w.make_data()), w.GLOBAL_BATCH, seed=0)
    return w, w.make_data(), model, MSELoss(), opt, params, grads, sampler


def simulate_localsgd(period: int) -> tuple[dict[int, float], dict[str, np.ndarray]]:
    """Local SGD replica by replica: losses by step and replica 0's final parameters."""
    from mpidist.optim.base import OptimizerState

    w, data, model, loss, opt, params, grads, sampler = _setup()
    reps = [params.data.copy() for _ in range(_size(1))]
    states = [opt.init_state(params.data.size, dtype=np.dtype("float64")) for _ in reps]
    losses: dict[int, float] = {}

    def average(ws: list[float], with_state: bool) -> None:
        avg = sum(wr * p for wr, p in zip(ws, reps, strict=True))
        for p in reps:
            p[:] = avg
        if with_state:
            for key in states[0].buffers:
                mean = sum(wr * s.buffers[key] for wr, s in zip(ws, states, strict=True))
                for s in states:
                    s.buffers[key][:] = mean

    for step in range(1, STEPS + 1):
        n = _size(step)
        if n != len(reps):  # the new replicas start from the (already averaged) model
            reps = [reps[0].copy() for _ in range(n)]
            states = [OptimizerState(states[0].step, {k: v.copy() for k, v in
                                                      states[0].buffers.items()})
                      for _ in range(n)]
        total, weights = 0.0, []
        for r in range(n):
            x, y = data.batch(sampler.local_indices(step - 1, r, n))
            params.data[:] = reps[r]
            grads.zero_()
            value = loss.forward(model.forward(x), y)
            model.backward(loss.backward())
            opt.update(params.data, grads.data, states[r])
            reps[r][:] = params.data
            weights.append(len(x) / w.GLOBAL_BATCH)
            total += value * weights[-1]
        losses[step] = total
        if step % period == 0:
            average(weights, with_state=False)
        if step in RESIZES:
            average(weights, with_state=True)
    params.data[:] = reps[0]
    return losses, {n: v.copy() for n, v in params.views().items()}


def simulate_async(staleness: int) -> tuple[dict[int, float], dict[str, np.ndarray]]:
    """Async SGD on the whole global batch, every in-flight gradient applied at a resize."""
    w, data, model, loss, opt, params, grads, sampler = _setup()
    state = opt.init_state(params.data.size, dtype=np.dtype("float64"))
    inflight: deque[np.ndarray] = deque()
    losses: dict[int, float] = {}
    for step in range(1, STEPS + 1):
        x, y = data.batch(sampler.global_indices(step - 1))
        grads.zero_()
        losses[step] = loss.forward(model.forward(x), y)
        model.backward(loss.backward())
        inflight.append(grads.data.copy())
        while len(inflight) > (staleness if step not in RESIZES else 0):
            opt.update(params.data, inflight.popleft(), state)
    return losses, {n: v.copy() for n, v in params.views().items()}


def _check(out: Path, want: tuple[dict[int, float], dict[str, np.ndarray]]) -> None:
    losses, params = want
    got = json.loads((out / "losses.json").read_text())
    assert got["workers"] == 2
    assert sorted(int(s) for s in got["losses"]) == list(range(1, STEPS + 1))
    for step, value in got["losses"].items():
        np.testing.assert_allclose(value, losses[int(step)], rtol=1e-9, err_msg=f"step {step}")
    with np.load(out / "final.npz") as final:
        for name, value in params.items():
            np.testing.assert_allclose(final[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


def _resizes(out: Path) -> list[tuple]:
    return [(e["event"], e["step"], e["from"], e["to"], e["hook"]) for e in events(out)]


def test_localsgd_resize_continues_from_the_average(tmp_path: Path):
    _mpiexec(2, tmp_path, "ddp", STEPS, ACTIONS, "--hook", "localsgd:3")
    _check(tmp_path, simulate_localsgd(3))
    assert _resizes(tmp_path) == [("join", 2, 2, 3, "localsgd"), ("leave", 5, 3, 2, "localsgd")]
    assert [e["replicas_averaged"] for e in events(tmp_path)] == [2, 3]


def test_async_resize_applies_in_flight_gradients(tmp_path: Path):
    _mpiexec(2, tmp_path, "ddp", STEPS, ACTIONS, "--hook", "async:1")
    _check(tmp_path, simulate_async(1))
    assert [e["flushed"] for e in events(tmp_path)] == [1, 1]


def test_topk_compression_survives_resizes(tmp_path: Path):
    # At ZeRO-2 (units reduce-scattered compressed): 2 -> 3 -> 2 workers, residuals reset.
    _mpiexec(2, tmp_path, "zero2", STEPS, ACTIONS, "--hook", "topk:0.25")
    got = json.loads((tmp_path / "losses.json").read_text())
    losses = [got["losses"][str(s)] for s in range(1, STEPS + 1)]
    assert got["workers"] == 2 and np.isfinite(losses).all()
    ref = simulate_async(0)[0]  # staleness 0 is plain synchronous training
    assert losses[0] == pytest.approx(ref[1], rel=1e-12)  # before any update
    assert losses[-1] < 0.6 * losses[0]
    evs = events(tmp_path)
    assert _resizes(tmp_path) == [("join", 2, 2, 3, "compressed"),
                                  ("leave", 5, 3, 2, "compressed")]
    for e in evs:
        assert e["reset_state"] == "compression_topk" and e["reset_state_norm"] > 0
    with np.load(tmp_path / "final.npz") as final:
        assert all(np.isfinite(final[n]).all() for n in final.files)


def test_hybrid_pp2_dp_1_to_2_and_back(tmp_path: Path):
    fixed, elastic = tmp_path / "fixed", tmp_path / "elastic"
    fixed.mkdir()
    elastic.mkdir()
    _run([MPIEXEC, "-n", "2", *_worker_args(fixed, "zero1", 6, "", "--pp", "2", "--fixed")],
         _env())
    # 2 -> 4 workers (dp 1 -> 2: old rank 1 moves from stage 1 to stage 0), back to 2 (the
    # stage-1 ranks leave, old rank 1 moves back), then a leave that would break the mesh.
    _mpiexec(2, elastic, "zero1", 6, "2:scale=4,4:scale=2,5:leave@1", "--pp", "2")
    want = json.loads((fixed / "losses.json").read_text())["losses"]
    got = json.loads((elastic / "losses.json").read_text())["losses"]
    assert sorted(got) == sorted(want) and len(got) == 6
    for step, value in want.items():
        np.testing.assert_allclose(got[step], value, rtol=1e-10, atol=0, err_msg=step)
    with np.load(fixed / "final.npz") as a, np.load(elastic / "final.npz") as b:
        for name in a.files:
            np.testing.assert_allclose(b[name], a[name], rtol=1e-10, atol=1e-13, err_msg=name)
    check_final(elastic, 6, 2)  # and the single-process run's
    evs = events(elastic)
    assert [(e["event"], e["step"], e["to"]) for e in evs] == \
        [("join", 2, 4), ("leave", 4, 2), ("refused", 5, 1)]
    assert evs[1]["left"] == [2, 3]
    assert "not a multiple of pipeline_parallel_size=2" in evs[2]["reason"]


def test_elastic_hook_and_mesh_arguments():
    base, config = SGD(lr=0.1), ShardingConfiguration()
    with pytest.raises(ValueError, match="runs on a data-parallel mesh"):
        ElasticOptimizer(base, config, hook=LocalSGD(2), pipeline_parallel_size=2,
                         handle_sigterm=False)
    with pytest.raises(ValueError, match="pipeline_parallel_size=0"):
        ElasticOptimizer(base, config, pipeline_parallel_size=0, handle_sigterm=False)
    opt = ElasticOptimizer(base, config, strategy="zero1", hook=LocalSGD(2, shard_group=2),
                           handle_sigterm=False)
    with pytest.raises(ValueError, match="groups of 2 of the 4 ranks: use level 0"):
        opt._size_refusal(4)
    opt = ElasticOptimizer(base, config, hook=LocalSGD(2, shard_group=2),
                           handle_sigterm=False)
    assert "does not divide the 3 data-parallel ranks" in opt._size_refusal(3)
    assert opt._size_refusal(4) is None
    opt = ElasticOptimizer(base, config, pipeline_parallel_size=2, tensor_parallel_size=2,
                           handle_sigterm=False)
    assert "not a multiple of pipeline_parallel_size=2 x tensor_parallel_size=2 = 4" in \
        opt._size_refusal(6)
    assert opt.strategy == "hybrid"  # what its checkpoints record, as HybridShardedOptimizer's
    assert ElasticOptimizer(base, config, zero_stage=2, handle_sigterm=False).strategy == "zero2"
