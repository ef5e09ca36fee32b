"""mpidist across two nodes: the virtual cluster of jobs/virtual-cluster.sh (2 nodes x 2 ranks,
a 1 Gbit/s link between them).

Opt-in: set ``MPIDIST_TEST_CLUSTER=1`` (``make test-cluster`` does). The module fixture builds
its own cluster (namespaces named ``mpdtest1``, ``mpdtest2``, state in a temporary directory)
and removes it at the end; where no cluster can be built here (not root, no ``ip``) the
tests skip with the script's reason. Every job runs with ``jobs/virtual-cluster.sh mpirun``,
as a user would:

* ``mpidist train`` with DDP, ZeRO-3 and the hybrid meshes pp 2 x dp 2 and tp 2 x dp 2
  reproduces single-process training in float64 (DDP and ZeRO-3 with the two-level
  collectives forced, the hybrid meshes with the automatic choice);
* a checkpoint written across the nodes resumes at another world size on the same trajectory;
* the elastic supervisor (``mpidist run --elastic``) loses a whole node (all its processes
  killed) and continues on the other node with the same trajectory;
* ``mpidist env`` reports the two nodes;
* jobs/train-multi-node.sbatch runs with ``sbatch -N 2`` on a Slurm with one slurmd per node
  (``jobs/virtual-cluster.sh slurm``; Slurm's packages are installed when
  ``jobs/local-slurm.sh`` can, else that test skips);
* two-level collectives equal the flat ones, and the mesh keeps tensor-parallel groups inside
  a node when the launcher deals ranks round-robin (tests/cluster/collectives_job.py).
* benchmarks/hierarchical.py (``make bench-cluster``) runs at its smallest size and prints
  its tables (its smoke run; tests/test_benchmarks.py runs the other benchmarks').
* a node whose processes run under a CPU quota is named a straggler host, its ranks
  straggler ranks, and the other node's ranks are not (skipped where no cgroup can carry a
  CPU quota).

Run alone: ``MPIDIST_TEST_CLUSTER=1 python -m pytest -q -p no:cacheprovider tests/cluster``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cli_env import crashed_at

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "jobs" / "virtual-cluster.sh"
JOB = Path(__file__).resolve().parent / "collectives_job.py"

pytestmark = pytest.mark.skipif(
    os.environ.get("MPIDIST_TEST_CLUSTER") != "1",
    reason="virtual-cluster tests are opt-in: MPIDIST_TEST_CLUSTER=1 (make test-cluster)",
)

TINY = ["--global-batch", "8", "--n-layer", "2", "--n-head", "2", "--n-embd", "32",
        "--block-size", "16", "--dtype", "float64", "--eval-interval", "0",
        "--no-progress", "--seed", "3"]
JOB_TIMEOUT = 300


def _mpidist() -> list[str]:
    """The console script beside this interpreter (the project's venv)."""
    script = Path(sys.executable).with_name("mpidist")
    return [str(script)] if script.exists() else ["mpidist"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """A 2-node x 2-slot virtual cluster of this module's own, removed at the end."""
    env = dict(os.environ)
    env.update(MPIDIST_VCLUSTER_DIR=str(tmp_path_factory.mktemp("vcluster") / "state"),
               MPIDIST_VCLUSTER_NAME="mpdtest")
    check = subprocess.run([str(CLUSTER), "check"], capture_output=True, text=True,
                           env=env, check=True).stdout.strip()
    if check != "ok":
        pytest.skip(f"no virtual cluster here: {check}")
    up = subprocess.run([str(CLUSTER), "up", "--nodes", "2", "--ranks-per-node", "2",
                         "--link-gbit", "1"], capture_output=True, text=True, env=env)
    if up.returncode == 2:
        pytest.skip(up.stderr.strip())
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield env
    finally:
        down = subprocess.run([str(CLUSTER), "down"], capture_output=True, text=True, env=env)
        assert down.returncode == 0, down.stderr


def on_cluster(env: dict, n: int, args: list[str], cwd: Path, *, map_by: str = "slot",
               extra_env: dict | None = None) -> subprocess.CompletedProcess:
    run_env = dict(env, **(extra_env or {}))
    cmd = [str(CLUSTER), "mpirun", "-n", str(n), "--map-by", map_by, "--", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=run_env,
                         timeout=JOB_TIMEOUT)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("split", "train") == "train"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Single-process training, 6 steps, on the same global batch."""
    out = tmp_path_factory.mktemp("reference") / "run"
    subprocess.run([*_mpidist(), "train", "--out", str(out), "--steps", "6", "--strategy",
                    "ddp", "--checkpoint-interval", "0", *TINY], check=True,
                   capture_output=True, timeout=JOB_TIMEOUT)
    return losses(out)


def test_env_reports_two_nodes(cluster: dict, tmp_path: Path) -> None:
    res = on_cluster(cluster, 4, [*_mpidist(), "env", "--json"], tmp_path)
    rows = json.loads(res.stdout)["ranks"]
    assert {r["nodes"] for r in rows} == {2}
    assert [r["host"] for r in rows] == ["mpdtest1", "mpdtest1", "mpdtest2", "mpdtest2"]
    assert [r["local_rank"] for r in rows] == [0, 1, 0, 1]
    text = on_cluster(cluster, 4, [*_mpidist(), "env"], tmp_path).stdout
    assert "on 2 node(s)" in text


@pytest.mark.parametrize(
    ("name", "flags", "collectives"),
    [
        ("ddp", ["--strategy", "ddp"], "hierarchical"),
        ("zero3", ["--strategy", "zero3"], "hierarchical"),
        ("pp2dp2", ["--strategy", "hybrid", "--pp", "2", "--dp", "2", "--micro-batches", "2"],
         "auto"),
        ("tp2dp2", ["--strategy", "hybrid", "--tp", "2", "--dp", "2"], "auto"),
    ],
)
def test_training_across_nodes_matches_one_process(
    cluster: dict, reference: dict[int, float], tmp_path: Path, name: str, flags: list[str],
    collectives: str,
) -> None:
    out = tmp_path / name
    res = on_cluster(cluster, 4, [*_mpidist(), "train", "--out", str(out), "--steps", "6",
                                  "--checkpoint-interval", "0", *flags, *TINY], tmp_path,
                     extra_env={"MPIDIST_COLLECTIVES": collectives})
    got = losses(out)
    assert sorted(got) == sorted(reference)
    np.testing.assert_allclose([got[s] for s in sorted(got)],
                               [reference[s] for s in sorted(reference)], rtol=1e-10, atol=0)
    assert "mpdtest1:" in res.stdout and "mpdtest2:" in res.stdout  # the layout by node


def test_checkpoint_across_nodes_resumes_at_another_size(
    cluster: dict, reference: dict[int, float], tmp_path: Path
) -> None:
    full = tmp_path / "full"
    on_cluster(cluster, 4, [*_mpidist(), "train", "--out", str(full), "--steps", "6",
                            "--strategy", "zero3", "--checkpoint-interval", "3", "--keep", "5",
                            *TINY], tmp_path)
    # As if the job had died after step 3: resume from that checkpoint on 2 ranks, one per
    # node (another world size and another sharding of the ZeRO-3 state).
    part = crashed_at(full, 3, tmp_path / "part")
    on_cluster(cluster, 2, [*_mpidist(), "train", "--out", str(part), "--steps", "6",
                            "--strategy", "zero3", "--checkpoint-interval", "3", "--resume",
                            *TINY], tmp_path, map_by="node")
    got = losses(part)
    assert sorted(got) == [4, 5, 6]
    np.testing.assert_allclose([got[s] for s in (4, 5, 6)], [reference[s] for s in (4, 5, 6)],
                               rtol=1e-10, atol=0)
    events = [json.loads(line) for line in (part / "events.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "resume" and e.get("world_size") == 2 for e in events)


@pytest.mark.parametrize("map_by", ["slot", "node"])
def test_collectives_and_placement(cluster: dict, tmp_path: Path, map_by: str) -> None:
    res = on_cluster(cluster, 4, [sys.executable, str(JOB)], tmp_path, map_by=map_by)
    line = [s for s in res.stdout.splitlines() if s.startswith("{")][-1]
    report = json.loads(line)
    assert report["nodes"] == 2 and report["two_level"] and report["checked"] == 12
    expected = {"slot": ["mpdtest1", "mpdtest1", "mpdtest2", "mpdtest2"],
                "node": ["mpdtest1", "mpdtest2", "mpdtest1", "mpdtest2"]}[map_by]
    assert report["world_hosts"] == expected
    assert len(set(report["tp_hosts"])) == 1


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_elastic_supervisor_loses_a_whole_node(cluster: dict, tmp_path: Path) -> None:
    """All processes of the second node are killed mid-run (as when a node dies); the
    supervisor restarts the job on the first node from the last checkpoint, and the
    losses follow single-process training."""
    steps = 60
    args = ["--steps", str(steps), "--checkpoint-interval", "5", "--strategy", "ddp", *TINY]
    ref = tmp_path / "reference"
    subprocess.run([*_mpidist(), "train", "--out", str(ref), "--checkpoint-interval", "0",
                    "--steps", str(steps), "--strategy", "ddp", *TINY],
                   check=True, capture_output=True, timeout=JOB_TIMEOUT)
    state = Path(cluster["MPIDIST_VCLUSTER_DIR"])
    hostfile = tmp_path / "hosts"
    hostfile.write_text("mpdtest1 slots=2\nmpdtest2 slots=2\n")
    out = tmp_path / "run"
    env = dict(cluster, MPIDIST_VCLUSTER_HOSTFILE=str(hostfile))
    sup = subprocess.Popen(
        [*_mpidist(), "run", "--elastic", "--min-workers", "2", "--max-workers", "4", "-n", "4",
         "--max-restarts", "2", "--slots-file", str(hostfile), "--launcher",
         str(state / "mpirun"), "--", *_mpidist(), "train", "--out", str(out), "--resume", "auto",
         *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while len(_rows(out)) < 7:  # a checkpoint at step 5 is committed
            assert sup.poll() is None, sup.stdout.read() if sup.stdout else ""
            assert time.monotonic() < deadline, "the run did not reach step 7"
            time.sleep(0.05)
        # The node is gone: the scheduler's list no longer has it, its processes die.
        hostfile.write_text("mpdtest1 slots=2\n")
        pids = subprocess.run(["ip", "netns", "pids", "mpdtest2"], capture_output=True,
                              text=True, check=True).stdout.split()
        assert pids, "no process ran on the second node"
        for pid in pids:
            subprocess.run(["kill", "-KILL", pid], check=False)
        log, _ = sup.communicate(timeout=JOB_TIMEOUT)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sup.returncode == 0, log[-3000:]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    sup_events = [e for e in events if e.get("source") == "supervisor"]
    kinds = [e["event"] for e in sup_events]
    assert "crash" in kinds and "restart" in kinds and kinds[-1] == "finished", kinds
    restart = next(e for e in sup_events if e["event"] == "restart")
    assert restart["world_size"] == 2, restart
    got: dict[int, float] = {}
    for r in _rows(out):
        if r.get("split", "train") == "train":
            got[r["step"]] = r["loss"]  # after the restart, the rerun steps' values
    want = losses(ref)
    assert sorted(got) == list(range(1, steps + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(got)],
                               rtol=1e-10, atol=0)


def _slurm_ready() -> str:
    """"" when Slurm's programs are here (installing them when jobs/local-slurm.sh can),
    else the reason."""
    if all(shutil.which(p) for p in ("munged", "slurmctld", "slurmd", "sbatch")):
        return ""
    check = subprocess.run([str(REPO / "jobs" / "local-slurm.sh"), "check"],
                           capture_output=True, text=True, check=True).stdout.strip()
    if check != "ok":
        return check
    res = subprocess.run([str(REPO / "jobs" / "local-slurm.sh"), "install"],
                         capture_output=True, text=True, timeout=600)
    return "" if res.returncode == 0 else f"Slurm could not be installed: {res.stderr[-300:]}"


def test_multi_node_batch_script_on_a_two_node_slurm(cluster: dict, tmp_path: Path) -> None:
    reason = _slurm_ready()
    if reason:
        pytest.skip(reason)
    started = subprocess.run([str(CLUSTER), "slurm"], capture_output=True, text=True,
                             env=cluster, timeout=180)
    assert started.returncode == 0, started.stdout + started.stderr
    out = tmp_path / "out"
    env = dict(cluster, MPIDIST_HOME=str(REPO), MPIDIST_VENV=str(Path(sys.executable).parents[1]),
               MPIDIST_OUT=str(out), MPIDIST_TRAIN_ARGS=" ".join(
                   ["--steps", "4", "--checkpoint-interval", "2", "--global-batch", "8",
                    "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
                    "--eval-interval", "0"]))

    def on_first(*cmd: str) -> str:
        res = subprocess.run([str(CLUSTER), "exec", "mpdtest1", "--", *cmd], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout

    job = on_first("sbatch", "--parsable", "-N", "2", "--ntasks-per-node=2",
                   str(REPO / "jobs" / "train-multi-node.sbatch")).strip().split(";")[0]
    deadline = time.monotonic() + JOB_TIMEOUT
    state = ""
    while time.monotonic() < deadline:
        info = on_first("scontrol", "show", "job", job)
        state = info.split("JobState=")[1].split()[0]
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            break
        time.sleep(1)
    log = "".join(p.read_text() for p in tmp_path.glob(f"*-{job}.out"))
    assert state == "COMPLETED", f"job {job}: {state}\n{log[-3000:]}"
    assert "on 2 node(s)" in log and "mpdtest1" in log and "mpdtest2" in log, log[-2000:]
    assert sorted(losses(out)) == [1, 2, 3, 4]
    assert (out / "latest").exists()


def test_torch_backend_across_nodes(cluster: dict, tmp_path: Path) -> None:
    """torch's init_process_group("mpidist") with no variables across two nodes: the
    ranks on rank 0's node reach its key-value store at 127.0.0.1, the others by its host
    name; rank, world and local ranks come from MPI."""
    pytest.importorskip("torch")
    script = REPO / "tests" / "torch" / "backend_launch.py"
    res = on_cluster(cluster, 4, [sys.executable, str(script), "plain"], tmp_path,
                     extra_env={"PYTHONWARNINGS": "ignore"})
    rows = sorted((json.loads(line) for line in res.stdout.splitlines()
                   if line.startswith('{"rank"')), key=lambda r: r["rank"])
    assert [(r["rank"], r["size"], r["sum"]) for r in rows] == [(i, 4, 10.0) for i in range(4)]
    # torch's all_reduce of 1 MiB ran as mpidist's two-level collective across the nodes
    assert [(r["big"], r["two_level"]) for r in rows] == [(10.0, True)] * 4
    assert [r["env"]["LOCAL_RANK"] for r in rows] == ["0", "1", "0", "1"]
    assert {r["env"]["LOCAL_WORLD_SIZE"] for r in rows} == {"2"}


def test_hierarchical_benchmark_at_its_smallest_size(cluster: dict, tmp_path: Path) -> None:
    """benchmarks/hierarchical.py (`make bench-cluster`) needs a cluster, so its smoke run is
    here (tests/test_benchmarks.py sends it here): at its smallest size it runs and prints
    its tables, the collectives' and the time-to-loss one. Its figures are not checked."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "hierarchical.py"), "--layouts", "2x2",
           "--sizes-mb", "0.0625", "--reps", "1", "--han-reps", "1", "--train-steps", "4"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cluster, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:  # the script's own mpirun jobs go with it
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    for header in ("mpidist/bound", "default/mpidist", "vs DDP time", "link-bound ratio"):
        assert header in out, out[-3000:]


def _cpu_quota_group(name: str) -> tuple[Path | None, str]:
    """A new cgroup limited to a fifth of one core (v1's cpu controller, or v2's cpu.max),
    or (None, why there is none here)."""
    v1 = Path("/sys/fs/cgroup/cpu")
    v2 = Path("/sys/fs/cgroup")
    try:
        if (v1 / "cpu.cfs_quota_us").exists():
            group = v1 / name
            group.mkdir()
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text("20000")
            return group, ""
        if "cpu" in (v2 / "cgroup.controllers").read_text().split() \
                and "cpu" in (v2 / "cgroup.subtree_control").read_text().split():
            group = v2 / name
            group.mkdir()
            (group / "cpu.max").write_text("20000 100000")
            return group, ""
    except OSError as exc:
        return None, f"cannot make a CPU-quota cgroup here: {exc}"
    return None, "no cgroup cpu controller to put a CPU quota on (v1 cpu or v2 cpu.max)"


def test_straggler_node_under_a_cpu_quota_is_named(cluster: dict, tmp_path: Path) -> None:
    """The second node's processes are put under a CPU quota (a fifth of one core for both
    ranks) as training starts: its two ranks, and the node, are named stragglers; the first
    node's ranks are not."""
    group, why = _cpu_quota_group(f"mpidist-test-{os.getpid()}")
    if group is None:
        pytest.skip(why)
    out = tmp_path / "run"
    cmd = [str(CLUSTER), "mpirun", "-n", "4", "--map-by", "slot", "--", *_mpidist(), "train",
           "--out", str(out), "--steps", "24", "--checkpoint-interval", "0", "--strategy",
           "ddp", "--straggler-interval", "4", *TINY,
           # a model whose step is mostly computation: the quota's stalls land in it
           "--n-embd", "128", "--block-size", "64"]
    job = subprocess.Popen(cmd, cwd=tmp_path, env=cluster, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        moved: set[str] = set()
        deadline = time.monotonic() + JOB_TIMEOUT
        while job.poll() is None and time.monotonic() < deadline and not _rows(out):
            pids = subprocess.run(["ip", "netns", "pids", "mpdtest2"], capture_output=True,
                                  text=True, check=False).stdout.split()
            for pid in set(pids) - moved:  # the node's daemon and ranks, as they appear
                with contextlib.suppress(OSError):
                    (group / "cgroup.procs").write_text(pid)
                    moved.add(pid)
            time.sleep(0.02)
        log, _ = job.communicate(timeout=JOB_TIMEOUT)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
        with contextlib.suppress(OSError):
            group.rmdir()
    assert job.returncode == 0, log[-3000:]
    assert moved, "no process of the second node was seen"
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    named = [e for e in events if e["event"] == "straggler"]
    ranks = {d["rank"] for e in named for d in e["ranks"]}
    assert ranks == {2, 3}, (named, log[-2000:])
    assert any(e["hosts"] == ["mpdtest2"] for e in named), named
    assert all(d["host"] == "mpdtest2" for e in named for d in e["ranks"])
    summary = json.loads((out / "summary.json").read_text())
    assert {d["rank"] for e in summary["stragglers"] for d in e["ranks"]} == {2, 3}


def _ulfm_on_cluster(env: dict, map_by: str, kill: str, args: list[str],
                     cwd: Path) -> subprocess.CompletedProcess:
    """``args`` on 4 ranks under Open MPI 5's ``mpiexec --with-ft ulfm`` (the ULFM prefix,
    ``make ulfm``), started on the first node as jobs/virtual-cluster.sh starts its jobs,
    with ``MPIDIST_FT_KILL=kill``; skips without the prefix."""
    prefix = Path(os.environ.get("MPIDIST_ULFM_PREFIX") or REPO / ".ulfm")
    if not (prefix / "bin" / "mpiexec").exists():
        pytest.skip(f"no Open MPI 5 with fault tolerance at {prefix} (make ulfm)")
    state = Path(env["MPIDIST_VCLUSTER_DIR"])
    net = "10.77.0.0/24"
    cmd = [str(CLUSTER), "exec", "mpdtest1", "--", "env", f"LD_LIBRARY_PATH={prefix}/lib",
           f"MPIDIST_FT_KILL={kill}", "OMPI_ALLOW_RUN_AS_ROOT=1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1", str(prefix / "bin" / "mpiexec"), "--with-ft",
           "ulfm", "--hostfile", str(state / "hostfile"), "-n", "4", "--map-by", map_by,
           "--bind-to", "none", "--oversubscribe", "--prtemca", "plm_ssh_agent",
           str(state / "netns-rsh"), "--prtemca", "oob_tcp_if_include", net, "--mca", "btl",
           "self,sm,tcp", "--mca", "btl_tcp_if_include", net]
    for name in ("LD_LIBRARY_PATH", "PATH", "PYTHONPATH", "MPIDIST_FT_KILL",
                 "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"):
        cmd += ["-x", name]
    return subprocess.run(["timeout", "-k", "10", str(JOB_TIMEOUT), *cmd, *args],
                          capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=JOB_TIMEOUT + 30)


def test_in_job_recovery_across_nodes(cluster: dict, reference: dict, tmp_path: Path) -> None:
    """Under ULFM, ranks placed node by node: rank 3 (node 2) lost in step 4 is recovered in
    the job, and replaced by a spawned process, on the single-process trajectory; so is
    node 2 lost whole (ranks 2 and 3: their copies are held on node 1, the copies' stride
    is the 2 ranks of a node; the job goes on smaller from here on); rank 1 and
    rank 3, which held its copy, lost together end the job in one line; with round-robin
    placement (the mesh orders the ranks by node) the recovery matches ranks by mesh
    coordinates and recovers too."""
    # the first case grows back (a newcomer spawned, its place in the node-ordered mesh
    # exchanged); the others go on smaller
    args = [*_mpidist(), "train", "--steps", "6", "--strategy", "zero2",
            "--checkpoint-interval", "2", *TINY]
    one = _ulfm_on_cluster(cluster, "slot", "rank=3,step=4,phase=backward",
                           [*args, "--out", str(tmp_path / "one")], tmp_path)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert "lost rank 3; 3 rank(s) go on from step 3" in one.stdout, one.stdout[-3000:]
    assert "grown back to 4 rank(s) after step 4" in one.stdout, one.stdout[-3000:]
    args = [*args, "--regrow", "none"]
    got = losses(tmp_path / "one")
    assert sorted(got) == sorted(reference)
    assert max(abs(got[s] - reference[s]) for s in reference) <= 1e-9
    node = _ulfm_on_cluster(cluster, "slot", "rank=2,step=4,phase=backward;"
                            "rank=3,step=4,phase=backward",
                            [*args, "--out", str(tmp_path / "node")], tmp_path)
    said = node.stdout + node.stderr
    assert node.returncode == 0, said[-3000:]
    assert "lost ranks 2 and 3; 2 rank(s) go on from step 3" in node.stdout, said[-3000:]
    got = losses(tmp_path / "node")
    assert max(abs(got[s] - reference[s]) for s in reference) <= 1e-9
    pair = _ulfm_on_cluster(cluster, "slot", "rank=1,step=4,phase=backward;"
                            "rank=3,step=4,phase=backward",
                            [*args, "--out", str(tmp_path / "pair")], tmp_path)
    said = pair.stdout + pair.stderr
    if "died together" not in said:  # rank 3 learnt of rank 1's loss before its own
        # kill point (still in the step's batch check across the nodes): then it died in
        # the redone step, a second loss the job recovers from, on the same trajectory
        assert pair.returncode == 0 and "lost rank 1; 3 rank(s) go on" in said, said[-3000:]
        got = losses(tmp_path / "pair")
        assert max(abs(got[s] - reference[s]) for s in reference) <= 1e-9
    else:
        assert pair.returncode == 1, said[-3000:]
        assert "rank 1 and rank 3, which held its copy, died together" in said, said[-3000:]
    robin = _ulfm_on_cluster(cluster, "node", "rank=1,step=4,phase=backward",
                             [*args, "--out", str(tmp_path / "robin")], tmp_path)
    said = robin.stdout + robin.stderr
    assert robin.returncode == 0, said[-3000:]
    assert "lost rank 1; 3 rank(s) go on from step 3" in robin.stdout, said[-3000:]
    got = losses(tmp_path / "robin")
    assert sorted(got) == sorted(reference)
    assert max(abs(got[s] - reference[s]) for s in reference) <= 1e-9
