"""Every script in benchmarks/ runs at its smallest size and prints its table, so that none
can rot between two `make bench` runs. What is checked is that it runs (exit status 0) and
prints its table (the header line), not its figures (those are docs/performance.md's).

Each benchmarks/*.py is a case here: a script listed in :data:`SMOKE` runs (the MPI ones
under ``timeout mpiexec -n N``); one listed in :data:`ELSEWHERE` is run by another target,
named there; a script in neither list fails its case, so a new script must be given its
smallest size here. The runs are opt-in: ``MPIDIST_BENCH_SMOKE=1`` (``make
test-bench-smoke`` sets it, at most 4 minutes in all on 2 cores); without it only the
listing is checked. Scripts that need torch skip with a line when torch is missing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
LIMIT_S = 120  # one script at its smallest size; most take a few seconds


@dataclass(frozen=True)
class Smoke:
    """How a benchmark runs at its smallest size: ``ranks`` (0: plain python), its options
    (``{tmp}`` is a fresh directory), text of its table's header that its output must hold,
    whether it needs torch, whether it needs the fault-tolerance stack (``make ulfm``)."""

    ranks: int
    args: tuple[str, ...]
    headers: tuple[str, ...]
    torch: bool = False
    ulfm: bool = False


TINY_GPT = ("--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8")

SMOKE: dict[str, Smoke] = {
    "checkpoint_io.py": Smoke(
        2, ("--size-mb", "1", "--tensors", "8", "--repeats", "1", "--dir", "{tmp}",
            "--window-steps", "2"),
        ("best s", "throughput ratio", "async blocking / (host copy",
         "async window - plain window")),
    "collectives.py": Smoke(
        2, ("--min-kb", "1024", "--max-mb", "1"), ("mpidist ms", "raw ms")),
    "compression.py": Smoke(
        2, ("--steps", "2", "--global-batch", "8"),
        # and the meter's check (exact bytes, not a timing)
        ("bytes/step", "DDP bytes/step = 1.000 x 4 bytes x params")),
    # prepare against the tokenizers library, training start on token files and on text,
    # the data time of a blend
    "data.py": Smoke(
        0, ("--smallest", "--dir", "{tmp}"),
        ("x encode_batch", "first step after", "blend / one file")),
    "ddp_overhead.py": Smoke(
        2, ("--layers", "2", "--width", "16", "--reps", "2"), ("variant", "x limit")),
    "elastic.py": Smoke(
        2, ("--n-layer", "1", "--n-embd", "16", "--dir", "{tmp}/ckpt"),
        ("operation", "seconds")),
    "model_step.py": Smoke(
        0, ("--threads", "1", "--steps", "1", "--batch", "2", "--profile-top", "0",
            *TINY_GPT), ("mpidist.nn :",)),
    "optimizer_kernels.py": Smoke(
        0, ("--n", "4096", "--repeats", "2", "--gpt2-scale", "64"),
        ("GB/s", "x NumPy")),
    "pipeline_bubble.py": Smoke(
        2, ("--stages", "2", "--micro", "2", "--width", "16", "--micro-batch-size", "4",
            "--steps", "1"), ("(p-1)/(m+p-1)",)),
    "pipeline_schedules.py": Smoke(
        2, ("--micro", "4", "--width", "16", "--micro-batch-size", "4", "--steps", "1"),
        ("measured ms", "predicted ms")),
    "pipeline_zero3.py": Smoke(
        2, ("--micro", "2", "--steps", "1", "--n-layer", "2", "--n-embd", "16",
            "--block-size", "8", "--global-batch", "4"), ("working_peak", "traced_peak")),
    "plan_check.py": Smoke(
        2, ("--repeats", "2", "--two-level-repeats", "1", *TINY_GPT),
        ("mem pred MB", "sync meas ms")),
    # starts its own `mpiexec -n 2 mpidist train` and stops it with SIGTERM
    "preemption.py": Smoke(
        0, ("-n", "2", "--strategy", "ddp", "--", *TINY_GPT, "--global-batch", "4"),
        ("signal -> all ranks exited",)),
    # starts its own jobs: on the ULFM stack (jobs/ulfm-mpiexec) and under the supervisor
    "recovery.py": Smoke(
        0, ("--smallest",), ("kill -> next step", "time / none", "supervisor restart"),
        ulfm=True),
    "recorder.py": Smoke(
        2, ("--calls", "1000", "--rounds", "2", "--steps", "3", *TINY_GPT,
            "--global-batch", "4"), ("ns/call", "calls/step")),
    # the trace's cost per event, events per step, traced vs untraced training
    "timeline.py": Smoke(
        2, ("--events", "1000", "--rounds", "2", "--steps", "3", "--pairs", "1", *TINY_GPT,
            "--global-batch", "4"), ("ns/event", "record us/step", "traced / untraced")),
    "torch_backend.py": Smoke(
        2, ("--model", "transformer", "--steps", "1", "--rounds", "1", "--repeats", "2",
            "--sizes", "4096", "--out", "{tmp}"), ("/ gloo", "raw MPI"), torch=True),
    "vs_torch.py": Smoke(
        2, ("--model", "transformer", "--steps", "1", "--rounds", "1", "--repeats", "2",
            "--out", "{tmp}"), ("/ torch", "/ floor"), torch=True),
    "zero_memory.py": Smoke(
        2, ("--n-layer", "1", "--n-embd", "16"), ("formula MB", "measured/formula")),
}

# Scripts whose run lives in another target (not run twice), and modules that are no script.
ELSEWHERE: dict[str, str] = {
    "gpu_check.py": "make test-gpu-dry runs it (--dry-run)",
    "gpu_check_engine.py": "make test-gpu-dry runs it (gpu_check.py's engine items)",
    "gpu_check_ranks.py": "make test-gpu-dry runs it (gpu_check.py's ranks item)",
    "hierarchical.py": "make test-cluster runs it on the virtual cluster it needs "
                       "(tests/cluster/test_virtual_cluster.py)",
    "torch_models.py": "not a script: the models of vs_torch.py and torch_backend.py",
}

SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))


def test_every_listed_script_exists():
    stale = sorted((set(SMOKE) | set(ELSEWHERE)) - set(SCRIPTS))
    assert not stale, f"listed here but not in benchmarks/: {stale}"
    assert not set(SMOKE) & set(ELSEWHERE)


def _run(cmd: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``cmd`` in its own process group; on the limit, kill the whole group (a script
    that starts mpiexec itself leaves no rank behind)."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=LIMIT_S + 20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -9, out
    return proc.returncode, out


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_at_its_smallest_size(script: str, tmp_path: Path):
    if script in ELSEWHERE:
        pytest.skip(ELSEWHERE[script])
    assert script in SMOKE, (
        f"benchmarks/{script} has no smoke run: give it its smallest size in SMOKE "
        f"(tests/test_benchmarks.py), or say in ELSEWHERE which target runs it")
    if os.environ.get("MPIDIST_BENCH_SMOKE") != "1":
        pytest.skip("benchmark smoke runs are opt-in: MPIDIST_BENCH_SMOKE=1 "
                    "(make test-bench-smoke)")
    spec = SMOKE[script]
    if spec.torch and importlib.util.find_spec("torch") is None:
        pytest.skip(f"benchmarks/{script} needs torch (make setup WITH_TORCH=1)")
    prefix = Path(os.environ.get("MPIDIST_ULFM_PREFIX") or BENCH.parent / ".ulfm")
    if spec.ulfm and not (prefix / "lib" / "libmpi.so.40").exists():
        pytest.skip(f"benchmarks/{script} needs Open MPI 5 with fault tolerance at {prefix} "
                    "(make ulfm)")
    args = [a.replace("{tmp}", str(tmp_path)) for a in spec.args]
    cmd = [sys.executable, str(BENCH / script), *args]
    if spec.ranks:
        mpiexec = shutil.which("mpiexec")
        assert mpiexec, "mpiexec not on PATH"
        cmd = ["timeout", "-k", "10", str(LIMIT_S), mpiexec, "-n", str(spec.ranks), *cmd]
    rc, out = _run(cmd, tmp_path)
    tail = "\n".join(out.splitlines()[-30:])
    assert rc == 0, f"{' '.join(cmd)} exited {rc}:\n{tail}"
    missing = [h for h in spec.headers if h not in out]
    assert not missing, f"{' '.join(cmd)}: its table lacks {missing}:\n{tail}"
