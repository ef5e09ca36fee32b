"""In-job recovery from a lost rank (ULFM) against the supervisor's restart from a checkpoint.

    python benchmarks/recovery.py [--kills 5] [--phases forward,backward,...] [--pairs 15]
                                  [--parts recovery,hybrid,copies,restart,long]
                                  [--long-steps 300] [--every 50] [--long-interval 10]
                                  [--smallest] [-- more mpidist train flags]

On the fault-tolerance stack (``jobs/ulfm-mpiexec``: Open MPI 5 under ``--with-ft ulfm``;
``make ulfm``), 4 ranks of ``mpidist train --strategy zero2`` with :data:`GPT_4X128` (the
GPT 4 x 128 on the embedded byte corpus, ``make run``'s model while it trained on bytes):

1. **Recovery.** ``--kills`` runs per phase, each with one rank SIGKILLed at that phase of
   step 3 (``MPIDIST_FT_KILL``; the victim varies): the time from the kill to the
   survivors' next completed step, split into detect (kill -> rank 0 of the survivors
   starts recovering), shrink and agree, rebuild (the model on 3 ranks, the shards moved,
   the copies made anew), redo (the steps after the agreed one, up to the first completed
   one); the steps redone per failure. Goal: median total <= 2 s, at most 1 step redone.
2. **Copies.** One MPI job with two zero2 optimizers side by side, one with
   ``redundancy="buddy"``, one without: the bytes each rank sends per step for its copy
   (every point-to-point send counted by a hook on the traced communicators) against the
   formula (the gradient shard), and the step time with copies against without as the
   median of interleaved pairs (the order alternating), with the pairs' spread. Goal <= 1.10.
3. **The restart path.** ``mpidist run --elastic`` (the supervisor) over Debian's
   ``mpiexec`` (no fault tolerance), checkpoints every ``--restart-interval`` steps, a rank
   SIGKILLed from outside after step 6: the time from the kill to the restarted job's
   next completed step, and the steps lost (redone from the last checkpoint).

4. **Hybrid meshes.** As 1 (the backward of step 3) for pp2 x dp2 and tp2 x dp2 (ZeRO-1)
   and pp2 x tp2 (dp 1: its copies are whole local states): the survivors keep pp and tp,
   2 ranks go on and the third is released.
5. **A long job.** ``--long-steps`` (300) steps of zero2, checkpoints every
   ``--long-interval`` (10) steps, a rank SIGKILLed from outside by its pid every
   ``--every`` (50) steps, once the job has 4 ranks again: a failure-free run, in-job
   recovery with growing back (``--regrow spawn``: the replacement spawned and given the
   state at the next step boundary), and the supervisor's restart path over Debian's
   ``mpiexec``. Steps per second from step 5 to the last, as a share of the failure-free
   run's; the steps redone per failure (the step in progress at the kill and every later one
   the run went back over; goal <= 1 for in-job); the recovery stall (kill -> next step)
   and the join stall (training stopped while the replacement joined) apart.

Without the fault-tolerance stack it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "jobs" / "ulfm-mpiexec"
PHASES = ("forward", "backward", "update:0", "allgather", "optimizer", "agreement")
KILL_STEP = 3
LIMIT = 600
#: The GPT of the runs: 4 x 128, global batch 32 x 64 tokens (TrainConfig's defaults),
#: named so that its figures stay comparable whatever `make run` trains.
GPT_4X128 = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "global_batch": 32}
#: the hybrid meshes of part 4 (4 ranks; pp2 x tp2 has dp 1: its copies are whole states)
MESHES = {"pp2 x dp2 zero1": ("--strategy", "hybrid", "--pp", "2", "--zero-stage", "1"),
          "tp2 x dp2 zero1": ("--strategy", "hybrid", "--tp", "2", "--zero-stage", "1"),
          "pp2 x tp2": ("--strategy", "hybrid", "--pp", "2", "--tp", "2")}

COPIES = r"""
import json, sys, time
import numpy as np
from mpi4py import MPI
from mpidist.core import calls, comms
from mpidist.data import GlobalBatchSampler
from mpidist.parallel.redundancy import copy_bytes_per_step
from mpidist.run.build import make_data, make_model, make_strategy
from mpidist.run.config import TrainConfig

args = json.loads(sys.argv[1])
cfg = TrainConfig(strategy="zero2", **args["cfg"])
world = comms.world()


class Sent:
    bytes = 0

    def enter(self, call):
        if call.kind == "p2p" and call.op in ("Isend", "Send", "Sendrecv"):
            self.bytes += call.count * np.dtype(str(call.dtype)).itemsize


sent = Sent()
calls.add_hook(sent)
train, _ = make_data(cfg)
runs = {}
MODES = ("replay", "send", "none")
for mode in MODES:
    opt = make_strategy(cfg, world)
    opt.redundancy_mode = "none" if mode == "none" else "buddy"
    model = opt.wrap(make_model(cfg), seed=cfg.seed)
    if mode != "none":
        opt.redundancy.refresh = mode
    opt.sampler = GlobalBatchSampler(len(train), cfg.global_batch, seed=cfg.seed)
    runs[mode] = (opt, model)


def step(mode):
    opt, model = runs[mode]
    x, y = train.batch(opt.sampler.next_local(model.dp_rank, model.dp_size))
    world.Barrier()
    before = sent.bytes
    t0 = time.perf_counter()
    opt.step(model, (x, y))
    world.Barrier()
    return time.perf_counter() - t0, sent.bytes - before


for _ in range(2):  # warm-up (and the copies made)
    for mode in MODES:
        step(mode)
ratios, moved = {"replay": [], "send": []}, {m: [] for m in MODES}
for i in range(args["pairs"]):
    order = MODES[i % 3:] + MODES[:i % 3]  # each mode first, second and last in turn
    t = {}
    for mode in order:
        t[mode], b = step(mode)
        moved[mode].append(b)
    for mode in ratios:
        ratios[mode].append(t[mode] / t["none"])
opt, model = runs["replay"]
red = opt.redundancy
itemsize = np.dtype(model.dtype).itemsize
state = len(opt.state.buffers)
if world.Get_rank() == 0:
    print("RESULT " + json.dumps({
        "ratios": ratios, "bytes": moved,
        "formula": copy_bytes_per_step(2, model.layout.local_size, itemsize),
        "send_formula": ((1 + state) * model.layout.local_size + 1) * itemsize,
        "copies_nbytes": red.nbytes(), "recovery": opt.recovery_status(),
        "params": int(model.layout.numel)}), flush=True)
"""


def ulfm_missing() -> str | None:
    prefix = Path(os.environ.get("MPIDIST_ULFM_PREFIX") or REPO / ".ulfm")
    if not (prefix / "bin" / "mpiexec").exists() or not (prefix / "lib" / "libmpi.so.40").exists():
        return f"no Open MPI 5 with fault tolerance at {prefix} (make ulfm)"
    return None


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MPIDIST_FT_KILL", "MPIDIST_RESTART", "MPIDIST_RUN_LOCK_TOKEN")}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), **extra)
    return env


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _kill_spec(phase: str, victim: int) -> str:
    name, _, call = phase.partition(":")
    return f"rank={victim},step={KILL_STEP},phase={name}" + (f",call={call}" if call else "")


def recovery_run(tmp: Path, phase: str, victim: int, train: list[str],
                 mesh: tuple[str, ...] = ("--strategy", "zero2")) -> dict:
    """One run with a rank killed at ``phase`` of step 3 (``mesh``: the strategy's flags);
    its recovery's figures."""
    out = tmp / f"run-{uuid.uuid4().hex[:8]}"
    cmd = [str(LAUNCHER), "--timeout", str(LIMIT), "-n", "4", sys.executable, "-m",
           "mpidist", "train", *mesh, "--out", str(out), "--regrow", "none", *train]
    proc = subprocess.run(cmd, env=_env(MPIDIST_FT_KILL=_kill_spec(phase, victim)),
                          capture_output=True, text=True, timeout=LIMIT + 30, check=False)
    text = proc.stdout + proc.stderr
    killed = re.search(r"MPIDIST_FT_KILL: SIGKILL of rank \d+ .* at (\d+\.\d+)", text)
    rec = [e for e in _rows(out / "events.jsonl") if e["event"] == "recovered"]
    if proc.returncode != 0 or killed is None or len(rec) != 1:
        tail = "\n".join(text.splitlines()[-15:])
        raise RuntimeError(f"recovery run ({phase}, rank {victim}) exited {proc.returncode}"
                           f":\n{tail}")
    e, t_kill = rec[0], float(killed.group(1))
    started = e["detected_at"] + e["detect_s"]
    shutil.rmtree(out, ignore_errors=True)
    return {"detect": started - t_kill, "shrink": e["shrink_s"], "rebuild": e["rebuild_s"],
            "redo": e["redo_s"], "total": e["recovered_at"] + e["redo_s"] - t_kill,
            "redone": KILL_STEP - e["step"]}


def copies_run(model: dict, pairs: int) -> dict:
    cmd = [str(LAUNCHER), "--timeout", str(LIMIT), "-n", "4", sys.executable, "-c", COPIES,
           json.dumps({"cfg": model, "pairs": pairs})]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True,
                          timeout=LIMIT + 30, check=False)
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"copies run exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(found[0][len("RESULT "):])


def _rank_pids(tag: str) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"MPIDIST_BENCH_TAG={tag}".encode() in env and b"train" in cmd \
                and b"run" not in cmd and not cmd[0].endswith(b"mpiexec"):
            out.append(int(proc.name))
    return sorted(out)


def restart_run(tmp: Path, train: list[str], interval: int, kill_after: int) -> dict:
    """The supervisor over Debian's mpiexec; a rank SIGKILLed after step ``kill_after``."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise RuntimeError("no mpiexec on PATH for the restart path")
    out, tag = tmp / "restart", uuid.uuid4().hex
    cmd = [sys.executable, "-m", "mpidist", "run", "--elastic", "-n", "4", "--min-workers",
           "3", "--max-workers", "4", "--max-restarts", "1", "--", sys.executable, "-m",
           "mpidist", "train", "--strategy", "zero2", "--out", str(out), "--resume", "auto",
           "--checkpoint-interval", str(interval), *train]
    proc = subprocess.Popen(cmd, env=_env(MPIDIST_BENCH_TAG=tag), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics, events = out / "metrics.jsonl", out / "events.jsonl"
    t_kill = None
    deadline = time.monotonic() + LIMIT
    resumed_step = first_after = None
    while proc.poll() is None and time.monotonic() < deadline:
        if t_kill is None and any(r.get("step") == kill_after for r in _rows(metrics)):
            pids = _rank_pids(tag)
            if len(pids) >= 4:
                os.kill(pids[2], signal.SIGKILL)
                t_kill = time.time()
        elif t_kill is not None and first_after is None:
            resume = [e for e in _rows(events) if e["event"] == "resume" and e["time"] > t_kill]
            if resume:
                resumed_step = resume[0]["step"]
                if any(r.get("step") == resumed_step + 1 for r in _rows(metrics)):
                    first_after = time.time()
        time.sleep(0.01)
    _, err = proc.communicate(timeout=60)
    if proc.returncode != 0 or t_kill is None or first_after is None:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        raise RuntimeError(f"restart run exited {proc.returncode}:\n{err[-3000:]}")
    return {"total": first_after - t_kill, "lost": kill_after + 1 - resumed_step,
            "checkpoint": resumed_step, "interval": interval}


def _train_pids(out: Path) -> list[int]:
    """The processes of ``mpidist train --out out`` (the ranks, newcomers included)."""
    key, found = str(out).encode(), []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd[1:4] == [b"-m", b"mpidist", b"train"] and key in cmd:
            found.append(int(proc.name))
    return sorted(found)


def _latest_step(metrics: Path) -> int:
    rows = [r for r in _rows(metrics) if r.get("split") == "train"]
    return max((r["step"] for r in rows), default=0)


def long_run(tmp: Path, name: str, cmd: list[str], out: Path, env: dict[str, str], *,
             steps: int, every: int, first: int = 5) -> dict:
    """Run ``cmd`` (its ranks write ``out``) and SIGKILL one of its ranks from outside each
    time step ``k * every`` completed (``every`` 0: none, the failure-free run), once it
    has 4 ranks again. Seconds from step ``first`` to step ``steps``, the kills (wall time,
    the last step completed then)."""
    log = (tmp / f"long-{name}.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    metrics = out / "metrics.jsonl"
    kills: list[tuple[float, int]] = []
    t_first = t_last = None
    deadline = time.monotonic() + LIMIT
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            done = _latest_step(metrics)
            now = time.time()
            if t_first is None and done >= first:
                t_first = now
            if t_last is None and done >= steps:
                t_last = now
            due = every and done >= every * (len(kills) + 1) and done < steps
            if due:
                pids = _train_pids(out)
                if len(pids) >= 4:
                    os.kill(pids[(len(kills) + 1) % len(pids)], signal.SIGKILL)
                    kills.append((time.time(), done))
            time.sleep(0.01)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    events = _rows(out / "events.jsonl")
    end = [e for e in events if e["event"] == "end"]
    # (after a newcomer was killed, Open MPI's status is 137 or 1 although the job finished:
    # docs/fault-tolerance.md; the run's own end event says whether it did)
    if not end or end[-1]["step"] != steps or t_first is None or t_last is None:
        text = (tmp / f"long-{name}.log").read_text(errors="replace")
        raise RuntimeError(f"{name} run exited {proc.returncode}:\n{text[-3000:]}")
    return {"seconds": t_last - t_first, "steps": steps - first, "kills": kills,
            "events": events}


def long_runs(tmp: Path, train: list[str], steps: int, every: int, interval: int) -> dict:
    """The failure-free run, in-job recovery with growing back, and the supervisor's
    restart path, ``steps`` steps each, a rank killed every ``every`` steps."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise RuntimeError("no mpiexec on PATH for the restart path")
    flags = ["--strategy", "zero2", "--steps", str(steps), "--checkpoint-interval",
             str(interval), *train]
    res = {}
    for name in ("clean", "in-job", "restart"):
        out = tmp / f"long-{name}"
        train_cmd = [sys.executable, "-m", "mpidist", "train", "--out", str(out), *flags]
        if name == "restart":
            cmd = [sys.executable, "-m", "mpidist", "run", "--elastic", "-n", "4",
                   "--min-workers", "3", "--max-workers", "4", "--max-restarts",
                   str(steps // max(every, 1) + 1), "--", *train_cmd, "--resume", "auto"]
        else:
            cmd = [str(LAUNCHER), "--timeout", str(LIMIT), "-n", "4", *train_cmd]
        res[name] = long_run(tmp, name, cmd, out, _env(), steps=steps,
                             every=0 if name == "clean" else every)
        shutil.rmtree(out, ignore_errors=True)
    return res


def _long_figures(run: dict) -> dict:
    """Steps redone per failure (the step in progress at the kill, and every later one
    done before the run went back), join and recovery stalls."""
    events = run["events"]
    redone = []
    back = [e for e in events if e["event"] in ("recovered", "resume")]
    for (_, done), e in zip(run["kills"], back, strict=False):
        redone.append(done + 1 - e["step"])
    rec = [e["total_s"] for e in events if e["event"] == "recovered" and e.get("total_s")]
    grown = [e.get("stall_s", e.get("seconds", float("nan"))) for e in events
             if e["event"] == "grown"]
    return {"redone": redone, "recovery_s": rec, "join_s": grown}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=5, help="kills per phase (default 5)")
    ap.add_argument("--phases", default=",".join(PHASES),
                    help="phases to kill in (phase[:call], call 0: on entering it)")
    ap.add_argument("--pairs", type=int, default=15, help="interleaved step pairs")
    ap.add_argument("--restart-interval", type=int, default=4,
                    help="checkpoint interval of the restart path (default 4)")
    ap.add_argument("--parts", default="recovery,hybrid,copies,restart,long",
                    help="which of recovery, hybrid, copies, restart, long to run "
                         "(default: all)")
    ap.add_argument("--long-steps", type=int, default=300,
                    help="steps of the long runs (default 300)")
    ap.add_argument("--every", type=int, default=50,
                    help="a rank killed every this many steps in the long runs (default 50)")
    ap.add_argument("--long-interval", type=int, default=10,
                    help="checkpoint interval of the long runs (default 10)")
    ap.add_argument("--smallest", action="store_true",
                    help="a tiny GPT, one kill, two pairs (the test suite's run)")
    ap.add_argument("train_args", nargs="*", help="more `mpidist train` flags")
    args = ap.parse_args()
    why = ulfm_missing()
    if why:
        print(f"benchmarks/recovery.py: skipped: {why}")
        return
    model = dict(GPT_4X128)
    phases = args.phases.split(",")
    if args.smallest:
        model = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8, "global_batch": 8}
        args.kills, args.pairs, phases = 1, 2, ["backward"]
        args.long_steps, args.every, args.long_interval = 12, 5, 4
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in model.items()]
    train = [*flags, "--steps", str(KILL_STEP + 2), "--checkpoint-interval", "0",
             "--eval-interval", "0", "--eval-batches", "1", "--no-progress", *args.train_args]
    parts = args.parts.split(",")
    runs: dict = {}
    hybrid: dict = {}
    copies: dict = {}
    restart: dict = {}
    long: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "recovery" in parts:
            runs = {p: [recovery_run(Path(tmp), p, (k + 1) % 4, train)
                        for k in range(args.kills)] for p in phases}
        if "hybrid" in parts:
            meshes = dict(list(MESHES.items())[-1:]) if args.smallest else MESHES
            hybrid = {m: [recovery_run(Path(tmp), "backward", (k + 1) % 4, train, mesh)
                          for k in range(args.kills)] for m, mesh in meshes.items()}
        if "copies" in parts:
            copies = copies_run(model, args.pairs)
        if "restart" in parts:
            restart_train = [*flags, "--steps", "9", "--eval-interval", "0",
                             "--eval-batches", "1", "--no-progress", *args.train_args]
            restart = restart_run(Path(tmp), restart_train, args.restart_interval, 6)
        if "long" in parts:
            long_train = [*flags, "--eval-interval", "0", "--eval-batches", "1",
                          "--no-progress", *args.train_args]
            long = long_runs(Path(tmp), long_train, args.long_steps, args.every,
                             args.long_interval)
    report(runs, copies, restart, model)
    if hybrid:
        report_hybrid(hybrid)
    if long:
        report_long(long, args)


def report(runs: dict, copies: dict, restart: dict, model: dict) -> None:
    print(f"zero2 on 4 ranks, GPT {model['n_layer']}x{model['n_embd']}, global batch "
          f"{model['global_batch']} x {model['block_size']}, load {os.getloadavg()[0]:.2f}")
    total = float("nan")
    if runs:
        total = report_recovery(runs)
    if copies:
        report_copies(copies)
    if restart:
        report_restart(restart, runs, total)


def report_recovery(runs: dict) -> float:
    """Table 1; the median total."""
    kills = len(next(iter(runs.values())))
    print(f"\n1. recovery: kill -> next completed step (s), median over {kills} kill(s) per "
          "phase")
    print(f"{'phase':<12}{'detect':>8}{'shrink':>8}{'rebuild':>9}{'redo':>8}{'total':>8}"
          f"{'max':>8}{'redone':>8}")
    every = [r for rs in runs.values() for r in rs]
    for phase, rs in [*runs.items(), ("all", every)]:
        col = {k: _median([r[k] for r in rs]) for k in ("detect", "shrink", "rebuild", "redo",
                                                          "total", "redone")}
        print(f"{phase:<12}{col['detect']:8.3f}{col['shrink']:8.3f}{col['rebuild']:9.3f}"
              f"{col['redo']:8.3f}{col['total']:8.3f}{max(r['total'] for r in rs):8.3f}"
              f"{max(r['redone'] for r in rs):8d}")
    total = _median([r["total"] for r in every])
    print(f"median kill -> next step {total:.3f} s (goal <= 2 s: "
          f"{'met' if total <= 2 else 'NOT met'}); steps redone per failure at most "
          f"{max(r['redone'] for r in every)} (goal <= 1)")
    return total


def report_copies(copies: dict) -> None:
    n = copies["bytes"]["none"]
    print(f"\n2. copies (--redundancy buddy against none; {copies['params']:,} parameters; "
          f"{copies['copies_nbytes']:,} bytes of copies per rank)")
    print(f"{'refresh':<26}{'bytes/step/rank':>16}{'formula':>12}{'meas/formula':>14}"
          f"{'time / none':>13}{'spread':>15}")
    for mode, formula, what in (("replay", copies["formula"], "replay the update (used)"),
                                ("send", copies["send_formula"], "send the state")):
        added = _median([x - y for x, y in zip(copies["bytes"][mode], n, strict=True)])
        r = copies["ratios"][mode]
        print(f"{what:<26}{added:16,.0f}{formula:12,}{added / formula if formula else 0:14.3f}"
              f"{_median(r):13.3f}{min(r):8.3f}-{max(r):.3f}")
    r = copies["ratios"]["replay"]
    print(f"step time with copies / without: median {_median(r):.3f} over {len(r)} interleaved "
          f"rounds (goal <= 1.10: {'met' if _median(r) <= 1.10 else 'NOT met'})")


def report_restart(restart: dict, runs: dict, total: float) -> None:
    every = [r for rs in runs.values() for r in rs]
    print("\n3. against the restart path (supervisor, Debian's mpiexec, a checkpoint every "
          f"{restart['interval']} steps, killed in step 7, resumed from step "
          f"{restart['checkpoint']})")
    print(f"{'path':<28}{'kill -> next step s':>20}{'steps redone':>14}")
    print(f"{'in-job recovery (median)':<28}{total:20.3f}"
          f"{_median([x['redone'] for x in every]):14.1f}")
    print(f"{'supervisor restart':<28}{restart['total']:20.3f}{restart['lost']:14d}")
    if every:
        print(f"in-job / restart time {total / restart['total']:.3f}")


def report_hybrid(hybrid: dict) -> None:
    kills = len(next(iter(hybrid.values())))
    print(f"\n4. hybrid meshes (4 ranks, a rank killed in the backward of step {KILL_STEP}; "
          f"median over {kills} kill(s); 2 ranks go on, pp and tp kept)")
    print(f"{'mesh':<18}{'detect':>8}{'shrink':>8}{'rebuild':>9}{'redo':>8}{'total':>8}"
          f"{'redone':>8}")
    for mesh, rs in hybrid.items():
        col = {k: _median([r[k] for r in rs]) for k in ("detect", "shrink", "rebuild", "redo",
                                                          "total")}
        print(f"{mesh:<18}{col['detect']:8.3f}{col['shrink']:8.3f}{col['rebuild']:9.3f}"
              f"{col['redo']:8.3f}{col['total']:8.3f}{max(r['redone'] for r in rs):8d}")


def report_long(long: dict, args: argparse.Namespace) -> None:
    clean = long["clean"]
    rate = clean["steps"] / clean["seconds"]
    print(f"\n5. {args.long_steps} steps, a rank SIGKILLed from outside every {args.every} "
          f"steps (checkpoints every {args.long_interval}); steps/s from step 5 to the end")
    print(f"{'path':<30}{'steps/s':>9}{'share':>8}{'kills':>7}{'redone/failure':>16}"
          f"{'recovery s':>12}{'join s':>9}")
    print(f"{'failure-free (ULFM stack)':<30}{rate:9.2f}{1.0:8.3f}{0:7d}{'-':>16}{'-':>12}"
          f"{'-':>9}")
    for name, label in (("in-job", "in-job recovery + growing back"),
                        ("restart", "supervisor restart")):
        run = long[name]
        fig = _long_figures(run)
        r = run["steps"] / run["seconds"]
        red = fig["redone"]
        worst = f"{_median(red):.1f} (max {max(red)})" if red else "-"
        rec = f"{_median(fig['recovery_s']):.3f}" if fig["recovery_s"] else "-"
        join = f"{_median(fig['join_s']):.3f}" if fig["join_s"] else "-"
        print(f"{label:<30}{r:9.2f}{r / rate:8.3f}{len(run['kills']):7d}{worst:>16}{rec:>12}"
              f"{join:>9}")


if __name__ == "__main__":
    main()
