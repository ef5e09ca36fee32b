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
sys.path.insert(0, str(ROOT))  # this tree's mpidist, run as benchmarks/gpu_check.py
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


def device_copy_bandwidth(n: int, reps: int, timed: Callable, dry: bool
                          ) -> tuple[float, dict[str, float]]:
    """Bytes per second (read plus written) of a device-to-device copy of ``n`` float32:
    the fastest of Numba's copy (a cudaMemcpy, slower on Hopper than a copy kernel),
    CuPy's and torch's (copy kernels) where they work; and each one's figure."""
    import numpy as np
    from numba import cuda

    src, dst = cuda.to_device(np.ones(n, np.float32)), cuda.device_array(n, np.float32)
    out = {"numba memcpy": 2 * 4 * n / timed(lambda: dst.copy_to_device(src), reps)}

    if not dry:
        try:
            import cupy

            a, b = cupy.ones(n, cupy.float32), cupy.empty(n, cupy.float32)
            out["cupy"] = 2 * 4 * n / timed(lambda: b.__setitem__(Ellipsis, a), reps)

        except Exception as e:  # no CuPy here
            log(f"  cupy copy: skipped ({type(e).__name__})")
        try:
            import torch

            a, b = torch.ones(n, device="cuda"), torch.empty(n, device="cuda")
            out["torch"] = 2 * 4 * n / timed(lambda: b.copy_(a), reps)

        except Exception as e:  # no torch with CUDA here
            log(f"  torch copy: skipped ({type(e).__name__})")
    return max(out.values()), out


@item("bandwidth")
def check_bandwidth(args: argparse.Namespace) -> tuple[str, str]:
    import numpy as np
    from numba import cuda

    from mpidist import optim

    n = 1 << (8 if args.dry_run else 27)
    reps = 2 if args.dry_run else 10
    timed = _timer(args.dry_run)
    copy_bw, copies = device_copy_bandwidth(n, reps, timed, args.dry_run)
    log(f"  device-to-device copy ({n} float32): " + ", ".join(
        f"{k} {v / 1e9:.0f} GB/s" for k, v in copies.items()) + " (the fastest is the bar)")
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
    detail = (f"copy {copy_bw / 1e9:.0f} GB/s (" + ", ".join(
        f"{k} {v / 1e9:.0f}" for k, v in copies.items()) + "); " + ", ".join(rows))
    if args.dry_run:
        return "PASS", "dry run (simulator; speed goal not applied): " + detail
    return ("FAIL" if low else "PASS"), detail


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of GPT-2 small (124 M parameters, 148 tensors)."""
    from optimizer_kernels import gpt2_shapes  # benchmarks/, on the path as the script's

    return gpt2_shapes(1)


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


_MPI_ENV: dict[str, str] | None = None


def time_left(args: argparse.Namespace) -> float:
    """Seconds left before the run's ``--deadline`` (a large number without one)."""
    end = getattr(args, "deadline_at", None)
    return 1e9 if end is None else end - time.monotonic()


def _mpi_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment for the ranks: this tree on the path, and the carried wheels
    (``gpu-wheels/``, installed into ``gpu-wheels/prefix``) when the machine's own mpi4py
    cannot start MPI. Worked out once per run."""
    global _MPI_ENV
    if _MPI_ENV is not None:
        return dict(_MPI_ENV)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONWARNINGS="ignore")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    probe = [sys.executable, "-c", "from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); "
             "print(MPI.Get_library_version().splitlines()[0][:60])"]

    def works(env: dict[str, str]) -> str:
        try:
            proc = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            return ""
        if proc.returncode:
            log(f"  mpi4py cannot start MPI: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        return proc.stdout.strip() if proc.returncode == 0 else ""

    found = works(env)
    if found:
        log(f"  MPI: the machine's own mpi4py ({found})")
        _MPI_ENV = env
        return dict(env)
    wheels = sorted((ROOT / "gpu-wheels").glob("*.whl"))
    prefix = ROOT / "gpu-wheels" / "prefix"
    if wheels and not prefix.is_dir():  # from the carried files: no index is contacted
        # --prefix, not --target: --target drops the wheel's lib/ (Open MPI's libraries)
        install = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                   "--ignore-installed", "--no-compile", "--prefix", str(prefix)]
        proc = subprocess.run(install + [str(w) for w in wheels], capture_output=True,
                              text=True)
        log((proc.stdout + proc.stderr)[-2000:])
    sites = sorted(prefix.glob("lib/python*/site-packages"))
    if sites:
        env["PYTHONPATH"] = os.pathsep.join([str(sites[0]), env["PYTHONPATH"]])
        env["PATH"] = os.pathsep.join([str(prefix / "bin"), env.get("PATH", "")])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(prefix / "lib"), env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
        env["OPAL_PREFIX"] = str(prefix)
        found = works(env)
        if found:
            log(f"  MPI from the carried wheels ({', '.join(w.name for w in wheels)}): {found}")
            _MPI_ENV = env
            return dict(env)
    raise Skip("mpi4py cannot start MPI here, and gpu-wheels/ holds no working MPI "
               "(make gpu-wheels, where a package index is reachable)")


@item("env")
def check_env(args: argparse.Namespace) -> tuple[str, str]:
    env = _mpi_env(args)
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
        limit = min(300.0, time_left(args) - 5)
        if limit < 10:
            failed.append(f"{n} ranks: not run (the run's deadline)")
            continue
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=limit)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
            log(out[-4000:])
            failed.append(f"{n} ranks: timed out after {limit:.0f} s")
            results += [f"{n}r {r['what']}: {r['status']}" for r in
                        (json.loads(x) for x in out.splitlines() if x.startswith("{"))]
            continue
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


def write_summary(out: Path, rows: list[dict], pending: list[str]) -> None:
    """The summary table (``summary.md``) and its rows (``summary.json``) of the items
    done so far; the items still to run are listed as not run, so a run cut short by its
    time limit still says what it did and what it did not reach."""
    rows = rows + [{"item": n, "status": "NOT RUN", "detail": "the run ended before it",
                    "seconds": 0} for n in pending]
    table = ["| item | status | seconds | detail |", "|---|---|---|---|"]
    table += [f"| {r['item']} | {r['status']} | {r['seconds']} | {r['detail']} |" for r in rows]
    (out / "summary.md").write_text("\n".join(table) + "\n")
    (out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")


#: seconds an item needs at least to be started before the deadline
MIN_SECONDS = {"env": 10, "kernels": 30, "bandwidth": 15, "adamw": 20, "ranks": 45,
               "engine": 45, "engine_speed": 60}


def machine() -> str:
    """One line naming the GPU and the versions the check runs with."""
    parts = [f"python {sys.version.split()[0]}"]
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30)
        parts.append(proc.stdout.strip() or "nvidia-smi: no GPU")
    except (OSError, subprocess.TimeoutExpired):
        parts.append("no nvidia-smi")
    for mod in ("numpy", "numba", "numba_cuda", "torch", "cupy", "h5py", "mpi4py"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except Exception as e:  # absent, or broken: said, not fatal
            parts.append(f"{mod} ({type(e).__name__})")
    return "; ".join(parts)


def main() -> int:
    global LOG
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="directory for log and summary")
    p.add_argument("--dry-run", action="store_true", help="no GPU: simulator and CPU")
    p.add_argument("--only", default="", help="comma-separated items (default: all)")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="seconds the whole check may take: an item is started only with "
                        "enough of them left, the others are reported as not run")
    args = p.parse_args()
    if args.dry_run:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before numba.cuda is first imported
    args.deadline_at = time.monotonic() + args.deadline if args.deadline > 0 else None
    args.out.mkdir(parents=True, exist_ok=True)
    LOG = open(args.out / "gpu-check.log", "w")  # noqa: SIM115 - for the whole run
    names = [x for x in args.only.split(",") if x] or list(ITEMS)
    unknown = sorted(set(names) - set(ITEMS))
    if unknown:
        p.error(f"--only {','.join(unknown)}: items are {', '.join(ITEMS)}")
    log(f"gpu-check {'(dry run) ' if args.dry_run else ''}{machine()}")
    rows: list[dict] = []
    write_summary(args.out, rows, names)
    for i, name in enumerate(names):
        log(f"== {name}")
        start = time.perf_counter()
        if time_left(args) < MIN_SECONDS.get(name, 10):
            status, detail = "NOT RUN", f"{time_left(args):.0f} s left of --deadline"
        else:
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
        write_summary(args.out, rows, names[i + 1:])
    print("\n".join(f"{r['status']:4s} {r['item']}" for r in rows))
    return 1 if any(r["status"] in ("FAIL", "NOT RUN") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
