"""The engine items of the GPU check (``benchmarks/gpu_check.py`` registers them as
``engine`` and ``engine_speed``): mpidist's own training engine with its arrays on a GPU.

- ``engine``: ``mpidist train`` of a tiny GPT in float64 with ``--device cuda`` against the
  same run with ``--device cpu``, at 1 rank and under ``mpiexec -n 2`` (two ranks may share
  one GPU): every train and validation loss of ``metrics.jsonl`` equal within 1e-10
  (relative). Then the device run's last checkpoint is resumed on the CPU for 2 more steps
  and compared with the uninterrupted CPU run (a checkpoint written from device arrays and
  read into host arrays).
- ``engine_speed``: tokens/s of one training step (forward, backward, the AdamW update) of
  a GPT-2-small-sized GPT (12 layers, 768 wide, 1024 tokens, batch 8) through the engine at
  1 rank (the "ddp" strategy), in float32 and in mixed-bf16, against the same model with
  the same weights in torch eager on the same GPU (float32; bf16 autocast), with
  ``torch.optim.AdamW(fused=True)``. The steps are timed in alternation between device
  synchronizes (medians after warm-up, on random weights and tokens), and the losses of
  both must agree. Goal: >= 0.8x torch's tokens/s. Where the engine refuses mixed-bf16,
  that part is a SKIP with the engine's message and mixed-fp16 is measured too (torch with
  fp16 autocast and a GradScaler).

In a dry run (no GPU) both run the same logic on the CPU: the "device" side of ``engine``
with ``--device cpu``; ``engine_speed`` on a tiny GPT, its numbers reported and the speed
goal not applied. Both run their work in fresh processes (under the MPI environment of the
check, which the engine needs even at one rank), within a time budget each.

Run the items with ``python3 benchmarks/gpu_check.py --out DIR --only engine,engine_speed
[--dry-run]``. Standalone::

    python3 benchmarks/gpu_check_engine.py measure [--device cuda] [--tiny]

is what ``engine_speed`` runs in its fresh process: one JSON line per precision.
``profile`` (same options, ``--rows N``) prints the kernels of a few engine steps by
device time (torch's profiler), to see where a slow step goes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

#: the tiny GPT of the parity runs; every first start decays the learning rate over the 8
#: steps of the uninterrupted run, so a 6-step run and its resumption follow that run
TINY_TRAIN = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
              "--vocab-size", "256", "--global-batch", "8", "--dtype", "float64",
              "--no-progress", "--checkpoint-interval", "3", "--eval-interval", "3",
              "--lr-decay-steps", "8"]
FIRST_STEPS, RESUMED_STEPS = 6, 8
PARITY_TOL = 1e-10
#: seconds each item may take in all (the whole check must end within 8 minutes)
BUDGET_S = {"engine": 150.0, "engine_speed": 150.0}
DRY_BUDGET_S = 300.0

SPEED_GOAL = 0.8
#: the two precisions the goal is set for; mixed-fp16 stands in where bf16 is refused
REQUIRED = ("full", "mixed-bf16")
#: relative difference allowed between the engine's and torch's losses (first and last step)
LOSS_TOL = {"full": 1e-3, "mixed-bf16": 5e-2, "mixed-fp16": 2e-2}
GPT2_SMALL = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024,
              "vocab_size": 50304}
TINY_GPT = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "vocab_size": 256}
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


class PartFailed(Exception):
    """One part of an item failed; the message says how."""


def item_budget(args: argparse.Namespace, seconds: float) -> Budget:
    """An item's budget: ``seconds``, or what is left before the run's deadline
    (``args.deadline_at``, a ``time.monotonic()`` value, where there is one) less a margin."""
    end = getattr(args, "deadline_at", None)
    if end is not None:
        seconds = min(seconds, end - time.monotonic() - 5)
    return Budget(max(seconds, 0.0))


class Budget:
    """The seconds left of an item's time budget."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.seconds = seconds

    def left(self) -> float:
        """Seconds left; PartFailed when (nearly) none are."""
        left = self.end - time.monotonic()
        if left < 5:
            raise PartFailed(f"not run: the item's budget of {self.seconds:.0f} s is spent")
        return left


# -- pure logic (unit-tested) ---------------------------------------------------------------
def loss_rows(path: Path | str) -> dict[tuple[int, str], float]:
    """The losses of a ``metrics.jsonl``: ``(step, split) -> loss`` for each row with a
    "loss" (split "train" where a row names none; a later row of a key wins)."""
    out: dict[tuple[int, str], float] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            row = json.loads(line)
            if "loss" in row:
                out[(int(row["step"]), str(row.get("split", "train")))] = float(row["loss"])
    return out


def max_rel_diff(got: dict[tuple[int, str], float], want: dict[tuple[int, str], float]) -> float:
    """The largest ``|got - want| / |want|`` over the keys of ``got``; ValueError when
    ``got`` is empty or holds a key ``want`` lacks."""
    if not got:
        raise ValueError("no losses to compare")
    missing = sorted(set(got) - set(want))
    if missing:
        raise ValueError(f"losses at {missing[:3]} have no counterpart in the reference run")
    return max(abs(got[k] - want[k]) / max(abs(want[k]), 1e-300) for k in got)


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects printed one a line in ``text`` (a line cut off by a timeout, or
    any other line, is passed over)."""
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def last_error(stderr: str) -> str:
    """The line of a failed command's stderr that says why: the last one naming an error
    (mpiexec's own report after it is skipped), else the last line."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip() and not x.startswith("---")]
    named = [x for x in lines if "rror" in x]
    return ((named or lines or ["(no output)"])[-1])[:300]


def judge_speed(rows: list[dict[str, Any]], dry: bool) -> tuple[str, str]:
    """The status and detail of ``engine_speed`` from the rows ``measure`` printed.

    A part fails when the engine raised while training, when its losses differ from
    torch's beyond :data:`LOSS_TOL`, or (not in a dry run) when its tokens/s is below
    :data:`SPEED_GOAL` x torch's. The item passes when every :data:`REQUIRED` precision
    passed (in a dry run: float32, the one the CPU engine takes), is a SKIP when one of
    them could not be measured, and fails when any part failed."""
    parts, failed, passed = [], False, set()
    meta = next((r["meta"] for r in rows if "meta" in r), None)
    for r in (r for r in rows if "precision" in r):
        p = r["precision"]
        if "refused" in r:
            parts.append(f"{p}: SKIP (the engine refused it: {r['refused'][:200]})")
            continue
        if "error" in r:
            parts.append(f"{p}: FAIL ({r['error']})")
            failed = True
            continue
        ratio = r["engine_tps"] / r["torch_tps"]
        loss_diff = max(r["first_loss_diff"], r["last_loss_diff"])
        why = []
        if not loss_diff <= LOSS_TOL[p]:
            why.append(f"losses differ by {loss_diff:.1e} > {LOSS_TOL[p]:.0e}")
        if not dry and ratio < SPEED_GOAL:
            why.append(f"below the goal of {SPEED_GOAL}x")
        text = (f"{p}: engine {r['engine_tps']:,.0f} tokens/s ({r['engine_ms']:.1f} ms), torch "
                f"{r['torch_tps']:,.0f} ({r['torch_ms']:.1f} ms) = {ratio:.2f}x, loss diff "
                f"{loss_diff:.1e}")
        parts.append(text + (f" FAIL: {'; '.join(why)}" if why else ""))
        failed = failed or bool(why)
        if not why:
            passed.add(p)
    detail = "; ".join(parts) or "no measurement came back"
    if meta:
        detail += f" [{meta}]"
    if dry:
        detail = "dry run (CPU, tiny GPT; speed goal not applied): " + detail
    if failed or not parts:
        return "FAIL", detail
    need = ("full",) if dry else REQUIRED
    if all(p in passed for p in need):
        return "PASS", detail
    return "SKIP", detail


# -- engine: parity of `mpidist train` on the device with the CPU ---------------------------
def _run(cmd: list[str], env: dict[str, str], clock: Budget,
         log: Callable[..., None]) -> subprocess.CompletedProcess:
    """Run ``cmd`` within the budget; PartFailed (its output logged) when it fails."""
    log("  $ " + " ".join(Path(c).name if c == sys.executable else c for c in cmd))
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=clock.left())
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        log(out[-3000:])
        raise PartFailed(f"timed out after {e.timeout:.0f} s (the item's budget is "
                         f"{clock.seconds:.0f} s)") from None
    if proc.returncode:
        log(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise PartFailed(f"exit {proc.returncode}: {last_error(proc.stderr)}")
    return proc


def _launcher(n: int, env: dict[str, str], clock: Budget, skip: type[Exception]) -> list[str]:
    """The command prefix starting ``n`` ranks; ``skip`` when MPI cannot start them."""
    if n == 1:
        return []
    mpiexec = shutil.which("mpiexec", path=env.get("PATH"))
    if mpiexec is None:
        raise skip("no mpiexec")
    probe = [mpiexec, "-n", str(n), sys.executable, "-c",
             "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"]
    try:
        ok = subprocess.run(probe, env=env, capture_output=True, timeout=min(
            60.0, clock.left())).returncode == 0
    except subprocess.TimeoutExpired:
        ok = False
    if not ok:
        raise skip(f"mpiexec -n {n} cannot start MPI here")
    return [mpiexec, "-n", str(n)]


def parity_at(n: int, launch: list[str], device: str, work: Path, env: dict[str, str],
              clock: Budget, log: Callable[..., None]) -> str:
    """The parity runs at ``n`` ranks: CPU (8 steps), device (6 steps), the device run
    resumed on the CPU (2 steps). Returns the part's detail; PartFailed when it fails."""
    train = launch + [sys.executable, "-m", "mpidist.cli", "train"]
    cpu_dir, dev_dir = work / f"cpu-{n}r", work / f"device-{n}r"
    _run(train + TINY_TRAIN + ["--out", str(cpu_dir), "--steps", str(RESUMED_STEPS),
                               "--device", "cpu"], env, clock, log)
    _run(train + TINY_TRAIN + ["--out", str(dev_dir), "--steps", str(FIRST_STEPS),
                               "--device", device], env, clock, log)
    want = loss_rows(cpu_dir / "metrics.jsonl")
    got = loss_rows(dev_dir / "metrics.jsonl")
    if {(s, "train") for s in range(1, FIRST_STEPS + 1)} - set(got):
        raise PartFailed(f"the {device} run's metrics.jsonl lacks train losses: {sorted(got)}")
    err = max_rel_diff(got, want)
    log(f"  {n} rank(s): {len(got)} losses, {device} against cpu: max rel diff {err:.2e}")
    _run(train + ["--out", str(dev_dir), "--resume", "--steps", str(RESUMED_STEPS),
                  "--device", "cpu", "--no-progress"], env, clock, log)
    resumed = {k: v for k, v in loss_rows(dev_dir / "metrics.jsonl").items()
               if k[0] > FIRST_STEPS}
    if {(s, "train") for s in range(FIRST_STEPS + 1, RESUMED_STEPS + 1)} - set(resumed):
        raise PartFailed(f"the resumed run's metrics.jsonl lacks train losses after step "
                         f"{FIRST_STEPS}: {sorted(resumed)}")
    err2 = max_rel_diff(resumed, want)
    log(f"  {n} rank(s): resumed on the CPU, {len(resumed)} losses: max rel diff {err2:.2e}")
    detail = (f"{n}r: {len(got)} losses max rel diff {err:.1e}, {device} checkpoint resumed "
              f"on CPU {len(resumed)} losses {err2:.1e}")
    if not (err <= PARITY_TOL and err2 <= PARITY_TOL):
        raise PartFailed(detail + f" > {PARITY_TOL:.0e}")
    return detail


def parity(args: argparse.Namespace, *, log: Callable[..., None],
           mpi_env: Callable[[argparse.Namespace], dict[str, str]],
           skip: type[Exception]) -> tuple[str, str]:
    """The ``engine`` item: ``(status, detail)``. ``skip`` is raised (by ``mpi_env``) when
    MPI cannot start even one rank."""
    device = "cpu" if args.dry_run else "cuda"
    clock = item_budget(args, DRY_BUDGET_S if args.dry_run else BUDGET_S["engine"])
    env = mpi_env(args)
    for var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(var, "1")  # tiny runs, ranks sharing cores
    work = Path(args.out).resolve() / "engine-runs"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    parts, failed, ran = [], False, False
    for n in (1, 2):
        try:
            launch = _launcher(n, env, clock, skip)
            parts.append(parity_at(n, launch, device, work, env, clock, log))
            ran = True
        except PartFailed as e:
            parts.append(f"{n}r: FAIL ({e})")
            failed = True
        except skip as e:
            parts.append(f"{n}r: SKIP ({e})")
    detail = "; ".join(parts)
    if args.dry_run:
        detail = "dry run (the device side ran on the CPU): " + detail
    if failed:
        return "FAIL", detail
    return ("PASS" if ran else "SKIP"), detail


# -- engine_speed ------------------------------------------------------------------------
def speed(args: argparse.Namespace, *, log: Callable[..., None],
          mpi_env: Callable[[argparse.Namespace], dict[str, str]],
          skip: type[Exception]) -> tuple[str, str]:
    """The ``engine_speed`` item: ``(status, detail)``, measured in a fresh process.
    ``skip`` is raised (by ``mpi_env``) when MPI cannot start the engine's one rank."""
    clock = item_budget(args, DRY_BUDGET_S if args.dry_run else
                        BUDGET_S["engine_speed"])
    env = mpi_env(args)  # the engine asks MPI for its (one-rank) world
    cmd = [sys.executable, str(Path(__file__).resolve()), "measure"]
    if args.dry_run:
        cmd += ["--device", "cpu", "--tiny"]
        for var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env.setdefault(var, "1")
    log("  $ " + " ".join(cmd[1:]))
    error = ""
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=clock.left())
        out, err = proc.stdout, proc.stderr
        if proc.returncode:
            error = f"measure exited {proc.returncode}: {last_error(err)}"
    except subprocess.TimeoutExpired as e:  # the rows printed so far still count
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        error = f"measure timed out after {e.timeout:.0f} s (budget {clock.seconds:.0f} s)"
    except PartFailed as e:
        return "FAIL", str(e)
    log(out[-6000:] + err[-4000:])
    rows = json_lines(out)
    status, detail = judge_speed(rows, args.dry_run)
    return ("FAIL", f"{error}; {detail}") if error else (status, detail)


def _twin(cfg: Any, params: dict[str, Any], device: str, precision: str) -> Callable[..., Any]:
    """The same GPT in torch eager with ``params`` (mpidist's names and layouts) copied in,
    and its AdamW; returns ``step(x, y) -> loss`` (forward, backward, update)."""
    import torch
    import torch.nn.functional as F
    from model_step import torch_gpt  # the twin model_step.py times on the CPU

    w, forward = torch_gpt(cfg, params, "float32", device)
    opt = torch.optim.AdamW(list(dict.fromkeys(w.values())), fused=True, **ADAMW)
    amp = {"mixed-bf16": torch.bfloat16, "mixed-fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device) if precision == "mixed-fp16" else None

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.autocast(device.split(":")[0], dtype=amp) if amp else nullcontext():
            logits = forward(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def alternate(steps: list[Callable[[], float]], warmup: int, reps: int,
              sync: Callable[[], None]) -> list[tuple[float, float, float]]:
    """``(median seconds, first value, last value)`` of each step, called in alternation
    (``warmup`` untimed rounds, then ``reps`` timed), each timed between device syncs."""
    times: list[list[float]] = [[] for _ in steps]
    first: list[float] = [0.0] * len(steps)
    last: list[float] = [0.0] * len(steps)
    for r in range(warmup + reps):
        for i, step in enumerate(steps):
            sync()
            t0 = time.perf_counter()
            value = step()
            sync()
            if r >= warmup:
                times[i].append(time.perf_counter() - t0)
            if r == 0:
                first[i] = value
            last[i] = value
    return [(statistics.median(t), f, v) for t, f, v in zip(times, first, last, strict=True)]


def _free_device_memory() -> None:
    """Give the memory of the last measurement back, so the next one has the GPU."""
    gc.collect()
    if "cupy" in sys.modules:
        sys.modules["cupy"].get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        sys.modules["torch"].cuda.empty_cache()


def measure_one(precision: str, cfg: Any, batch: tuple[Any, Any], device: str,
                warmup: int, reps: int) -> dict[str, Any]:
    """The engine's and torch's training step at ``precision``, as one JSON-able row."""
    import torch

    from mpidist import optim
    from mpidist.core.arrays import to_host
    from mpidist.nn import GPT, CrossEntropyLoss
    from mpidist.parallel import STRATEGIES, ShardingConfiguration

    row: dict[str, Any] = {"precision": precision}
    try:
        config = ShardingConfiguration(device=device, precision=precision, dtype="float32")
        opt = STRATEGIES["ddp"](optim.create("adamw", **ADAMW), config,
                                loss=CrossEntropyLoss())
        model = opt.wrap(GPT(cfg), seed=0)
    except (ValueError, NotImplementedError, ImportError, TypeError) as e:
        return {**row, "refused": f"{type(e).__name__}: {e}"}
    x, y = batch
    tx, ty = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    twin = _twin(cfg, {k: to_host(v) for k, v in model.full_parameters().items()}, device,
                 precision)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    try:
        (es, ef, el), (ts, tf, tl) = alternate(
            [lambda: opt.step(model, (x, y)), lambda: twin(tx, ty)], warmup, reps, sync)
    except Exception as e:  # the engine (or torch) failed while training: the part fails
        import traceback

        traceback.print_exc()
        return {**row, "error": f"{type(e).__name__}: {e}"[:400]}
    tokens = x.size
    return {**row, "engine_tps": tokens / es, "torch_tps": tokens / ts,
            "engine_ms": es * 1e3, "torch_ms": ts * 1e3,
            "engine_loss": [ef, el], "torch_loss": [tf, tl],
            "first_loss_diff": abs(ef - tf) / abs(tf), "last_loss_diff": abs(el - tl) / abs(tl),
            "steps": warmup + reps}


def measure_main(args: argparse.Namespace) -> int:
    """Print one JSON line per precision (and one of the setting): the ``measure`` command."""
    import numpy as np
    import torch

    from mpidist.nn import GPTConfig

    shape = TINY_GPT if args.tiny else GPT2_SMALL
    cfg = GPTConfig(**shape)
    b = args.batch or (4 if args.tiny else 8)
    rng = np.random.default_rng(1)
    batch = (rng.integers(0, cfg.vocab_size, (b, cfg.block_size)),
             rng.integers(0, cfg.vocab_size, (b, cfg.block_size)))
    warmup, reps = (1, 3) if args.tiny else (3, 10)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(json.dumps({"meta": f"GPT {shape['n_layer']}x{shape['n_embd']}, block "
                      f"{shape['block_size']}, vocab {shape['vocab_size']}, batch {b}; "
                      f"{reps} timed steps after {warmup}; {where}, torch {torch.__version__}, "
                      f"TF32 matmul torch {torch.backends.cuda.matmul.allow_tf32} CUPY_TF32="
                      f"{os.environ.get('CUPY_TF32', 'unset')}"}), flush=True)
    queue = [p for p in args.precisions.split(",") if p]
    while queue:
        precision = queue.pop(0)
        row = measure_one(precision, cfg, batch, args.device, warmup, reps)
        print(json.dumps(row), flush=True)
        if precision == "mixed-bf16" and "refused" in row and "mixed-fp16" not in queue:
            queue.append("mixed-fp16")
        _free_device_memory()
    return 0


def profile_main(args: argparse.Namespace) -> int:
    """Where the engine's training step spends its GPU time: torch's profiler (CUPTI sees
    every kernel of the process: Numba's, CuPy's, cuBLAS's) around a few steps of the
    ``measure`` model at each precision; prints the kernels by total device time."""
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mpidist import optim
    from mpidist.nn import GPT, CrossEntropyLoss, GPTConfig
    from mpidist.parallel import STRATEGIES, ShardingConfiguration

    cfg = GPTConfig(**(TINY_GPT if args.tiny else GPT2_SMALL))
    b = args.batch or (4 if args.tiny else 8)
    rng = np.random.default_rng(1)
    batch = (rng.integers(0, cfg.vocab_size, (b, cfg.block_size)),
             rng.integers(0, cfg.vocab_size, (b, cfg.block_size)))
    activities = [ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    for precision in [p for p in args.precisions.split(",") if p]:
        try:
            config = ShardingConfiguration(device=args.device, precision=precision,
                                           dtype="float32")
            opt = STRATEGIES["ddp"](optim.create("adamw", **ADAMW), config,
                                    loss=CrossEntropyLoss())
            model = opt.wrap(GPT(cfg), seed=0)
        except (ValueError, NotImplementedError) as e:
            print(f"== {precision}: refused ({e})", flush=True)
            continue
        for _ in range(2):  # compile and warm up
            opt.step(model, batch)
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        sync()
        steps = 3
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                opt.step(model, batch)
            sync()
        wall = (time.perf_counter() - t0) / steps
        key = "device_time_total" if args.device.startswith("cuda") else "cpu_time_total"
        events = prof.key_averages()
        device_total = sum(getattr(e, "self_device_time_total", 0) for e in events) / steps
        print(f"== {precision}: {wall * 1e3:.1f} ms per step (profiled), kernels "
              f"{device_total / 1e3:.1f} ms per step", flush=True)
        print(events.table(sort_by=key, row_limit=args.rows, max_name_column_width=70),
              flush=True)
        _free_device_memory()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("measure", "profile"))
    p.add_argument("--rows", type=int, default=25, help="profile: rows of the kernel table")
    p.add_argument("--device", default="cuda", help="measure: cuda or cpu (default: cuda)")
    p.add_argument("--tiny", action="store_true", help="measure: a tiny GPT")
    p.add_argument("--batch", type=int, default=0, help="measure: samples per step")
    p.add_argument("--precisions", default=",".join(REQUIRED),
                   help="measure: comma-separated precisions (default: full,mixed-bf16)")
    args = p.parse_args()
    return profile_main(args) if args.command == "profile" else measure_main(args)


if __name__ == "__main__":
    sys.exit(main())
