"""The jobs/ Slurm scripts, submitted with sbatch to a real one-node Slurm.

Opt-in: set ``MPIDIST_TEST_SLURM=1`` (``make test-slurm`` does). The module fixture starts
munged, slurmctld and slurmd with ``jobs/local-slurm.sh start`` (installing the Debian
packages when root) unless a Slurm is already answering, and stops what it started at the
end. Each test submits one script (or the resume chain) with a tiny model given through
``MPIDIST_TRAIN_ARGS``, polls ``scontrol show job`` until the job ends (there is no
accounting database, so no sacct; ``MinJobAge`` keeps ended jobs visible), and checks the
exit code and what the job wrote: metrics.jsonl rows, checkpoints, summary.json and
events.jsonl.

Run alone (the jobs use 4 tasks each; the machine may have only 2 cores):
``MPIDIST_TEST_SLURM=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_slurm.py``
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "jobs"
LOCAL_SLURM = JOBS / "local-slurm.sh"

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        os.environ.get("MPIDIST_TEST_SLURM") != "1",
        reason="Slurm job tests are opt-in: MPIDIST_TEST_SLURM=1 (make test-slurm)",
    ),
]

# A tiny run: each job trains for a few seconds once its ranks have started.
TINY = ("--global-batch 8 --n-layer 1 --n-head 2 --n-embd 32 --block-size 32 "
        "--checkpoint-interval 2 --eval-interval 0 --eval-batches 1")
JOB_TIMEOUT = float(os.environ.get("MPIDIST_SLURM_JOB_TIMEOUT", "300"))
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def _slurm_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:  # with a slurm.conf but no slurmctld, sinfo retries for its MessageTimeout
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                           check=False, timeout=60)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0 and any(s in r.stdout for s in ("idle", "mixed", "allocated"))


@pytest.fixture(scope="module")
def slurm():
    """A running one-node Slurm; started here (and stopped after) unless already up."""
    check = subprocess.run([str(LOCAL_SLURM), "check"], capture_output=True, text=True,
                           check=True).stdout.strip()
    started = False
    if not _slurm_answers():
        if check != "ok":
            pytest.skip(f"no Slurm here and jobs/local-slurm.sh cannot start one ({check})")
        subprocess.run([str(LOCAL_SLURM), "start"], check=True, timeout=600)
        started = True
    yield
    if started:
        subprocess.run([str(LOCAL_SLURM), "stop"], check=False, timeout=120)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The submit directory: job output files and runs/ land here."""
    return tmp_path


def _job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MPIDIST_HOME=str(REPO), MPIDIST_VENV=sys.prefix)
    # Settings of the test process that must not leak into the job's ranks.
    for key in ("MPIDIST_OUT", "MPIDIST_TRAIN_ARGS", "MPIDIST_STRATEGY", "MPIDIST_STEPS",
                "PYTEST_CURRENT_TEST"):
        env.pop(key, None)
    env.update(extra)
    return env


def _sbatch(workdir: Path, script: str, *args: str, **env: str) -> str:
    r = subprocess.run(["sbatch", "--parsable", *args, str(JOBS / script)], cwd=workdir,
                       env=_job_env(**env), capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"sbatch {script} failed: {r.stderr}"
    return r.stdout.strip().split(";")[0]


def _job(job_id: str) -> dict[str, str]:
    """`scontrol show job -o` as a dict (JobState, ExitCode, StartTime, StdOut, ...)."""
    r = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                       text=True, check=False)
    if r.returncode != 0:
        return {}
    out = {}
    for field in r.stdout.split():
        key, _, value = field.partition("=")
        out.setdefault(key, value)
    return out


def _output(info: dict[str, str]) -> str:
    path = info.get("StdOut")
    if path and os.path.exists(path):
        return Path(path).read_text(errors="replace").replace("\0", "")
    return f"(no output file {path!r})"


def _wait(job_id: str, timeout: float = JOB_TIMEOUT, while_running=None,
          poll: float = 1.0) -> dict[str, str]:
    """Poll until the job has ended; ``while_running(info)`` is called on each poll."""
    deadline = time.monotonic() + timeout
    while True:
        info = _job(job_id)
        state = info.get("JobState", "")
        if state in ENDED:
            return info
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], check=False)
            pytest.fail(f"job {job_id} still {state or 'unknown'} after {timeout:.0f}s\n"
                        + _output(info))
        if state == "RUNNING" and while_running is not None:
            while_running(info)
        time.sleep(poll)


def _assert_ok(info: dict[str, str]) -> str:
    text = _output(info)
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", (
        f"job {info.get('JobId')}: {info.get('JobState')} exit {info.get('ExitCode')}\n{text}")
    return text


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check_run(out: Path, *, steps: int, world_size: int, strategy: str,
               mesh: dict[str, int] | None = None) -> dict:
    """What every `mpidist train` run writes: metrics, checkpoints, summary."""
    train = [r for r in _rows(out / "metrics.jsonl") if r.get("split") == "train"]
    assert [r["step"] for r in train][-1] == steps
    assert sorted({r["step"] for r in train}) == list(range(1, steps + 1))
    assert all(r["loss"] == r["loss"] and 0 < r["loss"] < 10 for r in train)  # finite, sane
    assert any(r.get("split") == "validation" for r in _rows(out / "metrics.jsonl"))
    latest = (out / "latest").read_text().strip()
    assert latest == f"ckpt-{steps:08d}.h5" and (out / latest).is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == strategy
    assert summary["world_size"] == world_size
    assert summary["steps"] == steps
    if mesh is not None:
        assert summary["mesh"] == mesh
    return summary


@pytest.mark.timeout(600)
def test_single_node(slurm, workdir: Path) -> None:
    job = _sbatch(workdir, "train-single-node.sbatch",
                  MPIDIST_TRAIN_ARGS=f"--steps 4 {TINY}", MPIDIST_OUT="runs/single")
    text = _assert_ok(_wait(job))
    # `srun mpidist env`: the ranks detected Slurm as their launcher.
    assert "launcher        : slurm" in text
    assert "world size      : 4 on 1 node(s)" in text
    assert "all checksums verified" in text
    _check_run(workdir / "runs/single", steps=4, world_size=4, strategy="zero2",
               mesh={"pp": 1, "dp": 4, "tp": 1})
    assert (workdir / f"mpidist-train-{job}.out").is_file()


@pytest.mark.timeout(600)
def test_multi_node_script_on_one_node(slurm, workdir: Path) -> None:
    job = _sbatch(workdir, "train-multi-node.sbatch", "-N", "1",
                  MPIDIST_TRAIN_ARGS=f"--steps 4 {TINY}", MPIDIST_OUT="runs/multi")
    text = _assert_ok(_wait(job))
    assert "all checksums verified" in text
    _check_run(workdir / "runs/multi", steps=4, world_size=4, strategy="zero3",
               mesh={"pp": 1, "dp": 4, "tp": 1})


@pytest.mark.slow  # make test-slow
@pytest.mark.timeout(600)
def test_3d_hybrid(slurm, workdir: Path) -> None:
    job = _sbatch(workdir, "train-3d.sbatch",
                  MPIDIST_TRAIN_ARGS=f"--steps 4 {TINY} --n-layer 2",
                  MPIDIST_OUT="runs/3d")
    text = _assert_ok(_wait(job))
    assert "all checksums verified" in text
    _check_run(workdir / "runs/3d", steps=4, world_size=4, strategy="hybrid",
               mesh={"pp": 2, "dp": 1, "tp": 2})


@pytest.mark.slow  # make test-slow
@pytest.mark.timeout(600)
def test_resume_chain(slurm, workdir: Path) -> None:
    r = subprocess.run([str(JOBS / "submit-resume-chain.sh")], cwd=workdir,
                       env=_job_env(MPIDIST_CHAIN_STEPS="4 8", MPIDIST_OUT="runs/chain",
                                    MPIDIST_TRAIN_ARGS=TINY),
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.split()
    assert _job(second).get("Dependency", "").startswith(f"afterany:{first}")
    one = _wait(first)
    two = _wait(second)
    _assert_ok(one)
    _assert_ok(two)
    out = workdir / "runs/chain"
    _check_run(out, steps=8, world_size=4, strategy="zero1")
    events = _rows(out / "events.jsonl")
    resumes = [e for e in events if e["event"] == "resume"]
    assert [e["step"] for e in resumes] == [4]
    assert resumes[0]["checkpoint"] == "ckpt-00000004.h5"
    # Each step trained exactly once across the two jobs.
    train = [r["step"] for r in _rows(out / "metrics.jsonl") if r.get("split") == "train"]
    assert train == list(range(1, 9))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_this_run"] == 4


def _worker_pids(job_id: str) -> dict[int, int]:
    """{MPI rank: pid} of this job's `mpidist train` processes on this node."""
    found: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0")
                       if b"=" in kv)
        except OSError:
            continue
        if b"train" not in cmd or not any(c.endswith(b"mpidist") for c in cmd):
            continue
        if env.get(b"SLURM_JOB_ID") != job_id.encode():
            continue
        rank = env.get(b"OMPI_COMM_WORLD_RANK") or env.get(b"PMIX_RANK")
        if rank is not None:
            found[int(rank)] = int(proc.name)
    return found


@pytest.mark.timeout(900)
def test_elastic_survives_killed_task(slurm, workdir: Path) -> None:
    out = workdir / "runs/elastic"
    steps = 16  # long enough for the poll below to catch the run between checkpoints
    killed: list[int] = []

    def kill_one_rank_after_first_checkpoint(info: dict[str, str]) -> None:
        if killed or not (out / "events.jsonl").exists():
            return
        if not any(e["event"] == "checkpoint" for e in _rows(out / "events.jsonl")):
            return
        pids = _worker_pids(info["JobId"])
        victim = pids.get(1)
        if victim is not None:
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)

    job = _sbatch(workdir, "train-elastic.sbatch",
                  MPIDIST_TRAIN_ARGS=TINY.replace("--global-batch 8", "--global-batch 12")
                  + f" --steps {steps}", MPIDIST_OUT="runs/elastic")
    info = _wait(job, timeout=2 * JOB_TIMEOUT, while_running=kill_one_rank_after_first_checkpoint,
                 poll=0.2)
    text = _assert_ok(info)
    assert killed, f"never found a rank to kill\n{text}"
    events = _rows(out / "events.jsonl")
    kinds = [e["event"] for e in events]
    # The supervisor saw the crash, relaunched, and the relaunch resumed and finished.
    crashes = [e for e in events if e["event"] == "crash"]
    assert crashes and crashes[0]["returncode"] != 0, f"{kinds}\n{text}"
    assert "restart" in kinds and kinds[-1] == "finished", f"{kinds}\n{text}"
    resumes = [e for e in events if e["event"] == "resume"]
    assert resumes, f"no restart after killing pid {killed[0]}\n{text}"
    assert 2 <= resumes[-1]["world_size"] <= 4
    train = [r for r in _rows(out / "metrics.jsonl") if r.get("split") == "train"]
    assert train[-1]["step"] == steps
    resumed_at = resumes[-1]["step"]
    assert [r["step"] for r in train[resumed_at - steps:]] == list(range(resumed_at + 1, steps + 1))
    # Steps trained before the crash and again after it give the same loss: the restart
    # continued the same trajectory (same global batch, restored optimizer and data state).
    first: dict[int, float] = {}
    for r in train:
        if r["step"] in first:
            assert r["loss"] == pytest.approx(first[r["step"]], rel=1e-5), r
        first.setdefault(r["step"], r["loss"])
    assert json.loads((out / "summary.json").read_text())["steps"] == steps
    assert "all checksums verified" in text


@pytest.mark.timeout(900)
def test_preempted_job_checkpoints_requeues_and_finishes(slurm, workdir: Path) -> None:
    """What a time limit does with --signal=USR1@T, sent by hand: the ranks finish their
    step, checkpoint, rank 0 requeues the job, which starts again, resumes and finishes."""
    out = workdir / "runs/requeue"
    steps = 400  # long enough to be signalled mid-run; the tiny steps take milliseconds
    signalled: list[int] = []

    def preempt_after_a_few_steps(info: dict[str, str]) -> None:
        metrics = out / "metrics.jsonl"
        if signalled or not metrics.exists() or len(metrics.read_text().splitlines()) < 5:
            return
        subprocess.run(["scancel", "--signal=USR1", info["JobId"]], check=True)
        signalled.append(1)

    job = _sbatch(workdir, "train-requeue.sbatch", MPIDIST_OUT="runs/requeue",
                  MPIDIST_STEPS=str(steps), MPIDIST_STRATEGY="ddp",
                  MPIDIST_TRAIN_ARGS=f"{TINY} --checkpoint-interval 0 --eval-interval 0")
    info = _wait(job, while_running=preempt_after_a_few_steps, poll=0.2)
    text = _assert_ok(info)
    assert signalled, f"the job ended before it could be signalled\n{text}"
    assert int(info.get("Restarts", "0")) == 1, info
    assert f"requeued Slurm job {job}" in text and "start 2 of job" in text
    events = _rows(out / "events.jsonl")
    pre = [e for e in events if e["event"] == "preempted"]
    assert len(pre) == 1 and pre[0]["signal"] == "SIGUSR1", events
    assert pre[0]["requeue"] == f"requeued Slurm job {job}"
    stopped = pre[0]["step"]
    assert 0 < stopped < steps
    resumes = [e for e in events if e["event"] == "resume"]
    assert [e["step"] for e in resumes] == [stopped]
    train = [r["step"] for r in _rows(out / "metrics.jsonl") if r.get("split") == "train"]
    assert train == list(range(1, steps + 1))  # each step trained once across the starts
    assert (out / "latest").read_text().strip() == f"ckpt-{steps:08d}.h5"


@pytest.mark.timeout(600)
def test_torch_backend_under_srun(slurm, workdir: Path) -> None:
    """torch's init_process_group("mpidist") under `srun --mpi=pmix` takes its ranks from
    MPI; `srun --mpi=none` (no MPI plugin) is one clear line naming --mpi=pmix."""
    pytest.importorskip("torch")
    script = REPO / "tests" / "torch" / "backend_launch.py"
    run = f"{sys.executable} {script} plain"
    wrap = (f"srun --mpi=pmix {run}; echo pmix-rc=$?; "
            f"srun --mpi=none {run} 2>&1 | grep -m1 'srun started'; echo none-done")
    r = subprocess.run(["sbatch", "--parsable", "-n", "3", "-J", "mpidist-torch",
                        "-o", "%x-%j.out", "--wrap", wrap], cwd=workdir,
                       env=_job_env(PYTHONWARNINGS="ignore"), capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0, r.stderr
    text = _assert_ok(_wait(r.stdout.strip().split(";")[0]))
    rows = sorted((json.loads(line) for line in text.splitlines()
                   if line.startswith('{"rank"')), key=lambda row: row["rank"])
    assert [(row["rank"], row["size"], row["sum"], row["backend"]) for row in rows] == [
        (0, 3, 6.0, "mpidist"), (1, 3, 6.0, "mpidist"), (2, 3, 6.0, "mpidist")]
    assert "pmix-rc=0" in text
    assert "srun started 3 tasks but each is an MPI world of 1" in text
    assert "srun --mpi=pmix" in text


@pytest.mark.slow  # make test-slow
@pytest.mark.timeout(600)
def test_torch_fsdp_tp_job(slurm, workdir: Path) -> None:
    """jobs/torch-fsdp-tp.sbatch: torch's FSDP2 + TP under srun on the mpidist backend, then
    a resume with FSDP2 alone from the DCP checkpoint."""
    pytest.importorskip("torch")
    job = _sbatch(workdir, "torch-fsdp-tp.sbatch", MPIDIST_OUT="runs/torch",
                  MPIDIST_TORCH_ARGS="--steps 4 --checkpoint-interval 2",
                  MPIDIST_RESUME_STEPS="2", PYTHONWARNINGS="ignore")
    text = _assert_ok(_wait(job))
    assert "step     4  loss" in text and "saved runs/torch/step-00000004" in text
    assert "resumed at step 4 from runs/torch on 4 rank(s), fsdp" in text
    assert "saved runs/torch/step-00000006" in text
    assert (workdir / "runs/torch/latest").read_text().strip() == "6"


@pytest.mark.timeout(600)
def test_ulfm_job_survives_a_killed_rank(slurm, workdir: Path) -> None:
    """jobs/train-ulfm.sbatch: mpirun --with-ft ulfm inside the allocation; rank 2 SIGKILLs
    itself in step 5 (MPIDIST_FT_KILL), the other three recover in the job and finish with
    the single-process losses (float64, 1e-9); the job ends COMPLETED with exit code 0."""
    prefix = Path(os.environ.get("MPIDIST_ULFM_PREFIX") or REPO / ".ulfm")
    if not (prefix / "bin" / "mpiexec").exists():
        pytest.skip(f"no Open MPI 5 with fault tolerance at {prefix} (make ulfm)")
    steps = 8
    args = TINY + f" --steps {steps} --dtype float64 --no-progress"
    env = {k: v for k, v in _job_env().items() if not k.startswith("MPIDIST_FT")}
    job_args = args + " --regrow none"  # the survivors finish on 3 (growing back: tests/ft)
    ref = subprocess.run([sys.executable, "-m", "mpidist", "train", *args.split(), "--out",
                          str(workdir / "reference")], cwd=workdir, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    want = {r["step"]: r["loss"] for r in _rows(workdir / "reference/metrics.jsonl")
            if r["split"] == "train"}
    job = _sbatch(workdir, "train-ulfm.sbatch", MPIDIST_TRAIN_ARGS=job_args,
                  MPIDIST_OUT="runs/ulfm", MPIDIST_ULFM_PREFIX=str(prefix),
                  MPIDIST_FT_KILL="rank=2,step=5,phase=backward")
    text = _assert_ok(_wait(job))
    assert "fault tolerance : on (Open MPI v5" in text, text
    assert "in-job recovery on (--redundancy buddy" in text, text
    assert "SIGKILL of rank 2 at step 5" in text and "lost rank 2;" in text, text
    out = workdir / "runs/ulfm"
    summary = _check_run(out, steps=steps, world_size=3, strategy="zero2")
    assert [r["lost"] for r in summary["recoveries"]] == [[2]], summary["recoveries"]
    got = {r["step"]: r["loss"] for r in _rows(out / "metrics.jsonl") if r["split"] == "train"}
    assert sorted(got) == sorted(want)
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-9, (got, want)
    assert "all checksums verified" in text
