"""The GPU check: everything of mpidist that runs on a CUDA device, checked and timed in one
command (``make gpu-check GPU_CHECK_OUT=dir``), on a machine with no package index.

Usage::

    python3 benchmarks/gpu_check.py --out DIR [--dry-run] [--only NAME,...]

Items (each PASS, FAIL or SKIP with the reason; the log and a summary table go to ``DIR``):

- ``kernels``: every fused optimizer kernel (mpidist.optim's registry, several settings
  each) on Numba, CuPy and torch device arrays against the CPU kernel, float32 and float64,
  three steps; the largest relative error is printed. Goal: 1e-12 (float64), 1e-6 (float32).
- ``bandwidth``: each kernel on 2**27 float32 elements against the device-to-device copy
  measured in the same run (bytes read plus bytes written). Goal: >= 80% of the copy.
- ``adamw``: mpidist.torch.optim.AdamW against torch's ``AdamW(fused=True)`` on the
  parameters of a GPT-2-small-sized model (a list of tensors) and on one flat 2**27 vector:
  the same values after a step, and the step time. Goal: >= 1.0x torch's.
- ``env``: ``mpidist env`` names the rank's GPU and whether MPI is CUDA-aware.
- ``ranks``: under ``mpiexec -n 1`` and ``-n 2`` (two ranks may share one GPU):
  mpidist.torch DDP, ZeroRedundancyOptimizer and fully_shard, and torch's DDP and FSDP2 on
  the "mpidist" backend, all with CUDA tensors, against single-process training; a
  checkpoint round trip of CUDA state (``benchmarks/gpu_check_ranks.py``).
- ``engine``: ``mpidist train --device cuda`` of a tiny GPT at 1 and 2 ranks against the
  same run on the CPU (float64, 1e-10), and its checkpoint resumed on the CPU.
- ``engine_speed``: tokens/s of a training step of a GPT-2-small-sized GPT (batch 8 x 1024)
  through the engine against the same model in torch eager, float32 and mixed-bf16.
  Goal: >= 0.8x torch's (both in ``benchmarks/gpu_check_engine.py``).

``--dry-run`` runs the same logic without a GPU (CI does): the kernels under the Numba
CUDA simulator, the rest on CPU tensors with small sizes; the goals on speed are not
applied then. Nothing is installed: what the machine lacks (CuPy, an MPI runtime, a
CUDA-aware MPI) is a SKIP with the reason. ``make gpu-wheels`` (run where a package index
is reachable) downloads an Open MPI and mpi4py wheel into ``gpu-wheels/``, which the check
puts on the path when the machine's mpi4py cannot start MPI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ITEMS: dict[str, Callable[[argparse.Namespace], tuple[str, str]]] = {}
KERNEL_CASES = [
    ("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("sgd", {"lr": 0.05}),
    ("adam", {"lr": 0.01, "amsgrad": True, "maximize": True}),
    ("adamw", {"lr": 0.01, "weight_decay": 0.1}),
    ("rmsprop", {"lr": 0.01, "centered": True, "momentum": 0.9}),
    ("adagrad", {"lr": 0.05, "lr_decay": 0.01}),
    ("lion", {"lr": 0.001, "weight_decay": 0.1}),
]
TOL = {"float64": 1e-12, "float32": 1e-6}


class Skip(Exception):
    """An item (or part of one) that cannot run here, with the reason."""


def item(name: str) -> Callable:
    def register(fn: Callable) -> Callable:
        ITEMS[name] = fn
        return fn
    return register


def log(*a: object) -> None:
    print(*a, flush=True)
    if LOG is not None:
        LOG.write(" ".join(str(x) for x in a) + "\n")
        LOG.flush()


LOG = None


# -- device arrays of each library ----------------------------------------------------------
def libraries(dry: bool) -> dict[str, tuple[Callable, Callable]]:
    """name -> (host array -> device array, device array -> host array) of each library
    that works here; the others are logged as skipped."""
    import numpy as np
    from numba import cuda

    libs = {"numba": (cuda.to_device, lambda d: np.asarray(d.copy_to_host()))}
    if dry:
        log("  cupy, torch: skipped (dry run: no CUDA device; Numba's simulator only)")
        return libs
    try:
        import cupy

        libs["cupy"] = (cupy.asarray, cupy.asnumpy)
    except Exception as e:  # not installed, or no driver for it
        log(f"  cupy: skipped ({type(e).__name__}: {e})")
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        libs["torch"] = (lambda h: torch.from_numpy(h).cuda(), lambda d: d.cpu().numpy())
    except Exception as e:
        log(f"  torch: skipped ({type(e).__name__}: {e})")
    return libs


@item("kernels")
def check_kernels(args: argparse.Namespace) -> tuple[str, str]:
    import numpy as np

    from mpidist import optim

    n = 40 if args.dry_run else 1_000_003
    worst: dict[str, float] = {}
    failed = []
    for lib, (to_dev, to_host) in libraries(args.dry_run).items():
        for dtype in ("float64", "float32"):
            for name, hp in KERNEL_CASES:
                opt = optim.create(name, **hp)
                rng = np.random.default_rng(7)
                p = rng.standard_normal(n).astype(dtype)
                p_dev = to_dev(p.copy())
                st, st_dev = opt.init_state(p), opt.init_state(p_dev)
                for step in range(3):
                    g = rng.standard_normal(n).astype(dtype)
                    opt.update(p, g, st, grad_scale=0.5, lr=opt.lr * (step + 1) / 3)
                    opt.update(p_dev, to_dev(g), st_dev, grad_scale=0.5,
                               lr=opt.lr * (step + 1) / 3)
                err = float(np.max(np.abs(to_host(p_dev) - p)) / max(np.max(np.abs(p)), 1e-30))
                key = f"{lib} {dtype}"
                worst[key] = max(worst.get(key, 0.0), err)
                if not err <= TOL[dtype]:
                    failed.append(f"{lib} {dtype} {name} {hp}: {err:.2e}")
                log(f"  {lib:5s} {dtype} {name:7s} {json.dumps(hp):55s} rel err {err:.2e}")
    detail = ", ".join(f"{k} max {v:.1e}" for k, v in worst.items())
    if failed:
        return "FAIL", "; ".join(failed[:4]) + f" ({detail})"
    return "PASS", detail


def _timer(dry: bool) -> Callable[[Callable[[], None], int], float]:
    """A function timing ``fn`` (median seconds of ``reps`` runs after one warm-up): CUDA
    events around the launches on a GPU, the wall clock in a dry run."""
    if dry:
        def wall(fn: Callable[[], None], reps: int) -> float:
            fn()
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return statistics.median(times)
        return wall
    from numba import cuda

    def events(fn: Callable[[], None], reps: int) -> float:
        fn()
        cuda.synchronize()
        times = []
        for _ in range(reps):
            start, stop = cuda.event(), cuda.event()
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(cuda.event_elapsed_time(start, stop) / 1e3)
        return statistics.median(times)
    return events


@item("bandwidth")
def check_bandwidth(args: argparse.Namespace) -> tuple[str, str]:
    import numpy as np
    from numba import cuda

    from mpidist import optim

    n = 1 << (8 if args.dry_run else 27)
    reps = 2 if args.dry_run else 10
    timed = _timer(args.dry_run)
    src, dst = cuda.to_device(np.ones(n, np.float32)), cuda.device_array(n, np.float32)
    copy_s = timed(lambda: dst.copy_to_device(src), reps)
    copy_bw = 2 * 4 * n / copy_s
    log(f"  device-to-device copy: {copy_bw / 1e9:.0f} GB/s ({n} float32)")
    rows, low = [], []
    for name, hp in KERNEL_CASES[:1] + KERNEL_CASES[2:]:
        opt = optim.create(name, **hp)
        p, g = cuda.to_device(np.ones(n, np.float32)), cuda.to_device(np.full(n, 1e-3, "f4"))
        st = opt.init_state(p)
        seconds = timed(lambda opt=opt, p=p, g=g, st=st: opt.update(p, g, st), reps)
        moved = (3 + 2 * len(opt.state_names())) * 4 * n  # param r/w, grad r, state r/w
        ratio = moved / seconds / copy_bw
        rows.append(f"{name} {ratio:.2f}")
        log(f"  {name:7s} {moved / seconds / 1e9:7.0f} GB/s = {ratio:.2f} x copy")
        if ratio < 0.8:
            low.append(name)
    detail = f"copy {copy_bw / 1e9:.0f} GB/s; " + ", ".join(rows)
    if args.dry_run:
        return "PASS", "dry run (simulator; speed goal not applied): " + detail
    return ("FAIL" if low else "PASS"), detail


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of GPT-2 small (124 M parameters, 148 tensors)."""
    d, v, t, layers = 768, 50257, 1024, 12
    shapes: list[tuple[int, ...]] = [(v, d), (t, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,),
                   (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


@item("adamw")
def check_adamw(args: argparse.Namespace) -> tuple[str, str]:
    import torch

    from mpidist.torch.optim import AdamW

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise Skip("torch.cuda.is_available() is False")
    layouts = {"gpt2-small list": gpt2_small_shapes(), "flat 2**27": [(1 << 27,)]}
    if args.dry_run:
        layouts = {"small list": [(64, 32), (32,), (32, 16)], "flat 2**12": [(1 << 12,)]}
    timed = _timer(args.dry_run)
    out, slow = [], []
    for name, shapes in layouts.items():
        torch.manual_seed(0)
        mine = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
        ref = [torch.nn.Parameter(p.detach().clone()) for p in mine]
        for a, b in zip(mine, ref, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        ours = AdamW(mine, lr=1e-3)
        theirs = torch.optim.AdamW(ref, lr=1e-3, fused=True)
        ours.step()
        theirs.step()
        err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                  for a, b in zip(mine, ref, strict=True) for a, b in [(a.detach(), b.detach())])
        t_ours, t_theirs = timed(ours.step, 10), timed(theirs.step, 10)
        speed = t_theirs / t_ours
        out.append(f"{name}: {speed:.2f}x torch fused ({t_ours * 1e3:.2f} vs "
                   f"{t_theirs * 1e3:.2f} ms), rel err {err:.1e}")
        log("  " + out[-1])
        if err > 1e-5:
            return "FAIL", f"{name}: values differ from torch's by {err:.1e}"
        if speed < 1.0:
            slow.append(name)
    if args.dry_run:
        return "PASS", "dry run (CPU; speed goal not applied): " + "; ".join(out)
    return ("FAIL" if slow else "PASS"), "; ".join(out)


def _mpi_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment for the ranks: this tree on the path, and the carried wheels
    (``gpu-wheels/site``) when the machine's own mpi4py cannot start MPI."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONWARNINGS="ignore")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    probe = [sys.executable, "-c", "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"]
    if subprocess.run(probe, env=env, capture_output=True, timeout=60).returncode == 0:
        return env
    wheels = sorted((ROOT / "gpu-wheels").glob("*.whl"))
    site = ROOT / "gpu-wheels" / "site"
    if wheels and not site.is_dir():  # from the carried files: no index is contacted
        install = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                   "--target", str(site)] + [str(w) for w in wheels]
        log(subprocess.run(install, capture_output=True, text=True).stdout[-2000:])
    if site.is_dir():
        env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
        env["PATH"] = os.pathsep.join([str(site / "bin"), env.get("PATH", "")])
        if subprocess.run(probe, env=env, capture_output=True, timeout=60).returncode == 0:
            log(f"  MPI from the carried wheels ({', '.join(w.name for w in wheels)})")
            return env
    raise Skip("mpi4py cannot start MPI here, and gpu-wheels/ holds no working MPI "
               "(make gpu-wheels, where a package index is reachable)")


@item("env")
def check_env(args: argparse.Namespace) -> tuple[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run([sys.executable, "-m", "mpidist.cli", "env"], env=env,
                          capture_output=True, text=True, timeout=120)
    log(proc.stdout + proc.stderr[-2000:])
    if proc.returncode:
        return "FAIL", f"mpidist env exited {proc.returncode}"
    lines = proc.stdout.splitlines()
    aware = next((x for x in lines if "CUDA-aware MPI" in x), "")
    rank0 = next((x for x in lines if x.strip().startswith("0 ")), "")
    want = "no GPU" if args.dry_run else "GPU 0 of"
    status = "PASS" if want in rank0 and aware else "FAIL"
    return status, f"{rank0.strip()} | {aware.split('(')[-1].rstrip(')')}"


@item("ranks")
def check_ranks(args: argparse.Namespace) -> tuple[str, str]:
    env = _mpi_env(args)
    mpiexec = subprocess.run(["which", "mpiexec"], env=env, capture_output=True, text=True)
    results, failed = [], []
    for n in (1, 2):
        cmd = [sys.executable, str(HERE / "gpu_check_ranks.py"), "--out", str(args.out)]
        cmd += ["--device", "cpu" if args.dry_run else "cuda"]
        if n > 1:
            if mpiexec.returncode:
                results.append(f"{n} ranks: SKIP (no mpiexec)")
                continue
            cmd = [mpiexec.stdout.strip(), "-n", str(n)] + cmd
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        log(proc.stdout[-4000:] + proc.stderr[-4000:])
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not rows:
            failed.append(f"{n} ranks: exit {proc.returncode}")
            continue
        for r in rows:
            results.append(f"{n}r {r['what']}: {r['status']} {r.get('detail', '')}".strip())
            if r["status"] == "FAIL":
                failed.append(f"{n}r {r['what']}")
    return ("FAIL" if failed else "PASS"), "; ".join(results)


@item("engine")
def check_engine(args: argparse.Namespace) -> tuple[str, str]:
    import gpu_check_engine

    return gpu_check_engine.parity(args, log=log, mpi_env=_mpi_env, skip=Skip)


@item("engine_speed")
def check_engine_speed(args: argparse.Namespace) -> tuple[str, str]:
    import gpu_check_engine

    return gpu_check_engine.speed(args, log=log, mpi_env=_mpi_env, skip=Skip)


def main() -> int:
    global LOG
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="directory for log and summary")
    p.add_argument("--dry-run", action="store_true", help="no GPU: simulator and CPU")
    p.add_argument("--only", default="", help="comma-separated items (default: all)")
    args = p.parse_args()
    if args.dry_run:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before numba.cuda is first imported
    args.out.mkdir(parents=True, exist_ok=True)
    LOG = open(args.out / "gpu-check.log", "w")  # noqa: SIM115 - for the whole run
    names = [x for x in args.only.split(",") if x] or list(ITEMS)
    unknown = sorted(set(names) - set(ITEMS))
    if unknown:
        p.error(f"--only {','.join(unknown)}: items are {', '.join(ITEMS)}")
    log(f"gpu-check {'(dry run) ' if args.dry_run else ''}python {sys.version.split()[0]}")
    rows = []
    for name in names:
        log(f"== {name}")
        start = time.perf_counter()
        try:
            status, detail = ITEMS[name](args)
        except Skip as e:
            status, detail = "SKIP", str(e)
        except Exception as e:  # the item failed: its traceback is in the log
            status, detail = "FAIL", f"{type(e).__name__}: {e}"
            log(traceback.format_exc())
        rows.append({"item": name, "status": status, "detail": detail,
                     "seconds": round(time.perf_counter() - start, 1)})
        log(f"{status} {name} ({rows[-1]['seconds']} s): {detail}")
    table = ["| item | status | seconds | detail |", "|---|---|---|---|"]
    table += [f"| {r['item']} | {r['status']} | {r['seconds']} | {r['detail']} |" for r in rows]
    (args.out / "summary.md").write_text("\n".join(table) + "\n")
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(f"{r['status']:4s} {r['item']}" for r in rows))
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
