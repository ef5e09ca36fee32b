"""Elastic training end to end: workers leave and join running mpiexec jobs, and the
supervisor restarts crashed jobs from their checkpoint. Every run must end with the
parameters of an uninterrupted single-process run of the same global batch (float64).

Each test runs ``tests/run/launch/elastic_worker.py`` under mpiexec (membership changes end
processes, so these cannot run inside a pytest rank).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WORKER = str(HERE / "elastic_worker.py")
MPIEXEC = shutil.which("mpiexec")

pytestmark = [pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not on PATH"),
              pytest.mark.timeout(120)]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_async_mpi_finalize="1",
               OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    for key in ("MPIDIST_RESTART", "ELASTIC_WORKER_FAULT", "MPIDIST_SLOTS"):
        env.pop(key, None)
    env.update(extra)
    return env


def _worker_args(out: Path, strategy: str, steps: int, actions: str = "",
                 *more: str) -> list[str]:
    return [sys.executable, WORKER, "--strategy", strategy, "--steps", str(steps),
            "--out", str(out), "--actions", actions, *more]


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110,
                          cwd=str(ROOT))
    assert proc.returncode == 0, (proc.stdout + proc.stderr).replace("\0", "")
    return proc


def _mpiexec(n: int, out: Path, strategy: str, steps: int, actions: str, *more: str
             ) -> subprocess.CompletedProcess:
    return _run([MPIEXEC, "-n", str(n), *_worker_args(out, strategy, steps, actions, *more)],
                _env())


_REFERENCE: dict[int, tuple[dict[int, float], dict[str, np.ndarray]]] = {}


def reference(steps: int) -> tuple[dict[int, float], dict[str, np.ndarray]]:
    """Single-process training without MPI: losses by step and final parameters."""
    if steps in _REFERENCE:
        return _REFERENCE[steps]
    sys.path.insert(0, str(HERE))
    try:
        import elastic_worker as w
    finally:
        sys.path.remove(str(HERE))
    from mpidist.data import GlobalBatchSampler
    from mpidist.nn import MLP, MSELoss

    data, model, loss, opt = w.make_data(), MLP(w.SIZES), MSELoss(), w.make_base()
    params, grads = model.build(np.dtype("float64"), seed=0)
    state = opt.init_state(params.data.shape[0], dtype=np.dtype("float64"))
    sampler = GlobalBatchSampler(len(data), w.GLOBAL_BATCH, seed=0)
    losses = {}
    for step in range(steps):
        x, y = data.batch(sampler.global_indices(step))
        grads.zero_()
        losses[step + 1] = loss.forward(model.forward(x), y)
        model.backward(loss.backward())
        opt.update(params.data, grads.data, state)
    _REFERENCE[steps] = losses, {n: v.copy() for n, v in params.views().items()}
    return _REFERENCE[steps]


def check_final(out: Path, steps: int, workers: int) -> None:
    losses, params = reference(steps)
    got = json.loads((out / "losses.json").read_text())
    assert got["workers"] == workers
    for step, value in got["losses"].items():
        np.testing.assert_allclose(value, losses[int(step)], rtol=1e-9, err_msg=f"step {step}")
    with np.load(out / "final.npz") as final:
        assert sorted(final.files) == sorted(params)
        for name, want in params.items():
            np.testing.assert_allclose(final[name], want, rtol=1e-9, atol=1e-12, err_msg=name)


def events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_sigterm_leaves_4_to_3(tmp_path: Path):
    _mpiexec(4, tmp_path, "ddp", 6, "2:sigterm@2")
    check_final(tmp_path, 6, 3)
    (ev,) = events(tmp_path)
    assert (ev["event"], ev["step"], ev["from"], ev["to"], ev["left"]) == ("leave", 2, 4, 3, [2])


def test_two_leave_4_to_2_zero3(tmp_path: Path):
    _mpiexec(4, tmp_path, "zero3", 6, "3:leave@0,3:leave@2")
    check_final(tmp_path, 6, 2)
    (ev,) = events(tmp_path)
    assert (ev["event"], ev["step"], ev["to"], ev["left"]) == ("leave", 3, 2, [0, 2])


def test_spawn_2_to_4_zero1(tmp_path: Path):
    _mpiexec(2, tmp_path, "zero1", 6, "2:scale=4")
    check_final(tmp_path, 6, 4)
    (ev,) = events(tmp_path)
    assert (ev["event"], ev["step"], ev["from"], ev["to"]) == ("join", 2, 2, 4)


def test_spawn_3_to_4_then_leave_zero2(tmp_path: Path):
    # A join, then a joined worker and an original one leave in the same step.
    _mpiexec(3, tmp_path, "zero2", 7, "2:scale=4,4:leave@3,4:leave@1")
    check_final(tmp_path, 7, 2)
    kinds = [(e["event"], e["step"], e["from"], e["to"]) for e in events(tmp_path)]
    assert kinds == [("join", 2, 3, 4), ("leave", 4, 4, 2)]


def test_min_max_refusals(tmp_path: Path):
    _mpiexec(2, tmp_path, "zero2", 5, "2:leave@1,3:scale=5,4:scale=1", "--min", "2",
             "--max", "3")
    check_final(tmp_path, 5, 2)
    evs = events(tmp_path)
    assert [(e["event"], e["step"], e["to"]) for e in evs] == \
        [("refused", 2, 1), ("refused", 3, 5), ("refused", 4, 1)]
    assert "min_workers=2" in evs[0]["reason"] and "max_workers=3" in evs[1]["reason"]


def _supervised(tmp_path: Path, strategy: str, steps: int, actions: str, slots_after: int,
                **env: str) -> tuple[Path, list[dict]]:
    out = tmp_path / "run"
    out.mkdir()
    slots = tmp_path / "slots"
    slots.write_text("4\n")
    cmd = [sys.executable, "-m", "mpidist.run.launch.supervisor", "--elastic", "--min-workers",
           "2", "--max-workers", "4", "-n", "4", "--max-restarts", "2", "--slots-file",
           str(slots), "--", *_worker_args(out, strategy, steps, actions,
                                           "--checkpoint-interval", "2", "--resume")]
    _run(cmd, _env(ELASTIC_SLOTS_FILE=str(slots), ELASTIC_SLOTS_AFTER=str(slots_after), **env))
    return out, events(out)


def test_crash_restarts_from_checkpoint_on_3(tmp_path: Path):
    out, evs = _supervised(tmp_path, "zero1", 8, "5:kill@2", slots_after=3)
    check_final(out, 8, 3)
    sup = [(e["event"], e["step"], e["world_size"]) for e in evs if e.get("source")]
    assert sup == [("launch", None, 4), ("crash", 4, 4), ("restart", 4, 3), ("finished", 8, 3)]


def test_worker_dies_during_redistribution(tmp_path: Path):
    # Scale 4 -> 3 at step 3; old rank 1 exits in the middle of the Alltoallv phase. The
    # job must end and restart from checkpoint 2 (never continue in a half-moved state).
    out, evs = _supervised(tmp_path, "zero2", 6, "3:scale=3", slots_after=4,
                           ELASTIC_WORKER_FAULT="redistribute:1")
    check_final(out, 6, 3)
    sup = [(e["event"], e["step"], e["world_size"]) for e in evs if e.get("source")]
    assert sup[:3] == [("launch", None, 4), ("crash", 2, 4), ("restart", 2, 4)]
    assert sup[-1] == ("finished", 6, 4)  # the supervisor reports the launch's size
    inner = [(e["event"], e["step"], e["to"]) for e in evs if not e.get("source")]
    assert inner == [("leave", 3, 3)]  # only the second launch got that far
