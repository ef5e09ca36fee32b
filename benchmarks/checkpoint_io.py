"""Checkpoint save/load throughput next to raw file I/O of the same bytes, in the same run.

    mpiexec -n 4 python benchmarks/checkpoint_io.py [--size-mb 1024] [--tensors 300]
        [--dir DIR] [--repeats 5] [--json FILE] [--sections io,async,window,torch]
        [--window-steps 6]

State: ``--size-mb`` of float32 split into ``--tensors`` tensors with odd shapes, grouped
into units and sharded over the ranks with ``ShardedLayout`` (ZeRO-style pieces that do not
align with rows). Per repetition it times, with a Barrier before and after each:

* raw write: every rank ``tofile`` of its shard's bytes to its own file, then ``fsync``;
  each repetition writes new files (as training writes a new checkpoint file each time),
  the previous repetition's being deleted before the clock starts;
* save: :func:`save_checkpoint` (checksums, parallel HDF5 or the serial fallback, fsync,
  atomic rename, ``latest`` pointer);
* raw read: every rank ``fromfile`` of its file;
* load: :func:`read_pieces` of the same pieces, with and without checksum verification.

Before the reads every rank asks the kernel to evict the files from the page cache with
``posix_fadvise(DONTNEED)`` (the written pages are clean after fsync). That is best effort:
on some file systems, or with little memory pressure, reads may still be served from page
cache, for the raw read and the load alike. Throughput is total bytes over the slowest
rank's time; the ratio mpidist / raw is the goal metric (>= 0.7), printed for the best and
the median repetition of each (a shared disk's speed drifts between repetitions).

Asynchronous saves (``--sections async,window,torch``), each variant interleaved with the
one it is compared with in every repetition:

* async: the blocking time of ``save_checkpoint(..., async_=True)`` of the same state against
  a plain copy of the rank's pieces into a preallocated host buffer plus the agreement and
  layout phases of that save (``phase_seconds``; goal: <= 1.2x);
* window: ``--window-steps`` training steps of a GPT (DDP, AdamW, float32) whose model and
  optimizer state is ``--size-mb``, without a save, with one asynchronous save at the start
  (``optimizer.save(path, async_=True)``; committed in a later step or at the end), and with
  one blocking save. Goal: the asynchronous window within the plain window plus 25% of a
  blocking save's time. Also the background write's throughput while training runs against
  the blocking save's, and the mean step time while the writer runs against without;
* torch: a torch model of ``--size-mb`` of parameters and AdamW state over the "mpidist"
  process group, the blocking time of ``mpidist.torch.save_checkpoint(..., async_=True)``
  against torch DCP's ``async_save`` (reported).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from mpidist.checkpoint import Piece, TensorInfo, read_pieces, save_checkpoint
from mpidist.core.buffers import ShardedLayout


def make_units(total_bytes: int, n_tensors: int, per_unit: int = 12):
    """Odd-shaped float32 tensors adding up to about ``total_bytes``, in units."""
    rng = np.random.default_rng(0)
    weights = rng.uniform(0.2, 1.8, n_tensors)
    numels = np.maximum(7, (weights / weights.sum() * total_bytes / 4).astype(np.int64))
    units, unit = [], []
    for i, numel in enumerate(numels):
        cols = int(rng.choice([7, 129, 1023, 1531]))
        rows = max(1, int(numel) // cols)
        group = "params" if i % 3 == 0 else ("optimizer/exp_avg" if i % 3 == 1
                                              else "optimizer/exp_avg_sq")
        unit.append((f"{group}/layer{i // 3}.w", (rows, cols)))
        if len(unit) == per_unit:
            units.append(unit)
            unit = []
    if unit:
        units.append(unit)
    return units


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(comm, fn) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    comm.Barrier()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def io_section(comm, args, base: str, tensors, pieces) -> dict:
    """Save and load against raw file I/O of the same bytes (the first table)."""
    rank, size = comm.rank, comm.size
    total = sum(i.nbytes for i in tensors.values())
    local_bytes = sum(p.data.nbytes for p in pieces)
    raw_data = np.concatenate([p.data for p in pieces]) if pieces else np.empty(0, np.float32)
    outs = [Piece(p.name, p.flat, np.empty_like(p.data)) for p in pieces]
    times: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        # Fresh names every repetition for both, as training writes a new file per
        # checkpoint; the previous repetition's files are deleted before the clock
        # starts (freeing a replaced file's blocks is otherwise timed into the rename
        # or the truncation).
        raw_path = os.path.join(base, f"raw-{rep}-{rank}.bin")
        ckpt = os.path.join(base, f"ckpt-{rep + 1:08d}.h5")
        if rep:
            os.remove(os.path.join(base, f"raw-{rep - 1}-{rank}.bin"))
            if rank == 0:
                os.remove(os.path.join(base, f"ckpt-{rep:08d}.h5"))
        comm.Barrier()

        def raw_write(raw_path: str = raw_path) -> None:
            with open(raw_path, "wb") as fh:
                raw_data.tofile(fh)
                fh.flush()
                os.fsync(fh.fileno())

        t = {"raw write": timed(comm, raw_write),
             "save": timed(comm, lambda ckpt=ckpt: save_checkpoint(
                 ckpt, tensors, pieces, {"step": 1, "world_size": size}, comm=comm))}
        drop_cache(raw_path)
        if rank == 0:
            drop_cache(ckpt)
        comm.Barrier()
        t["raw read"] = timed(comm, lambda raw_path=raw_path: np.fromfile(
            raw_path, dtype=np.float32))
        t["load (verified)"] = timed(comm, lambda ckpt=ckpt: read_pieces(ckpt, outs, comm=comm))
        drop_cache(ckpt)
        comm.Barrier()
        t["load (no verify)"] = timed(
            comm, lambda ckpt=ckpt: read_pieces(ckpt, outs, comm=comm, verify=False))
        if not all(o.data.tobytes() == p.data.tobytes() for o, p in zip(outs, pieces,
                                                                         strict=True)):
            raise SystemExit(f"[rank {rank}] loaded data differs from saved data")
        for k, v in t.items():
            times.setdefault(k, []).append(v)
    comm.Barrier()
    os.remove(os.path.join(base, f"raw-{args.repeats - 1}-{rank}.bin"))
    if rank == 0:
        os.remove(os.path.join(base, f"ckpt-{args.repeats:08d}.h5"))
    if rank != 0:
        return {}
    stats = {"best": {k: min(v) for k, v in times.items()},
             "median": {k: float(np.median(v)) for k, v in times.items()}}
    gbs = {s: {k: total / v / 1e9 for k, v in d.items()} for s, d in stats.items()}
    print(f"checkpoint I/O: {size} rank(s), {len(tensors)} tensors, {total / 1e9:.3f} GB "
          f"({local_bytes / 1e6:.1f} MB on rank 0), dir {os.path.dirname(base)}, "
          f"{args.repeats} repetitions")
    print("reads follow posix_fadvise(DONTNEED) on every file; they may still come "
          "partly from page cache")
    print(f"  {'':<18} {'best s':>8} {'GB/s':>7}   {'median s':>8} {'GB/s':>7}")
    for k in times:
        print(f"  {k:<18} {stats['best'][k]:8.3f} {gbs['best'][k]:7.3f}   "
              f"{stats['median'][k]:8.3f} {gbs['median'][k]:7.3f}")
    pairs = {"save / raw write": ("save", "raw write"),
             "load (verified) / raw read": ("load (verified)", "raw read"),
             "load (no verify) / raw read": ("load (no verify)", "raw read")}
    ratios = {s: {k: gbs[s][a] / gbs[s][b] for k, (a, b) in pairs.items()} for s in gbs}
    print(f"  {'throughput ratio':<28} {'best':>6} {'median':>7}  (goal >= 0.7)")
    for k in pairs:
        print(f"  {k:<28} {ratios['best'][k]:5.2f}x {ratios['median'][k]:6.2f}x")
    return {"seconds": times, "gb_per_s": gbs, "ratios": ratios}


def timed_call(comm, fn) -> tuple[float, Any]:
    """:func:`timed`, and what ``fn`` returned."""
    out: list[Any] = []
    return timed(comm, lambda: out.append(fn())), out[0]


def _max(comm, value: float) -> float:
    return comm.allreduce(float(value), op=MPI.MAX)


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def async_section(comm, args, base: str, tensors, pieces) -> dict:
    """The blocking time of an asynchronous save against a plain host copy of the rank's
    pieces plus a save's agreement and layout (the phases of mpidist.checkpoint.phases)."""
    from mpidist.checkpoint.phases import agree_on_arguments, layout_posix, name_temp_file

    plain = np.empty(sum(p.data.nbytes for p in pieces), dtype=np.uint8)
    plain[:] = 0  # touched: a warm buffer, as the pool is after the first save
    views, at = [], 0
    for p in pieces:
        views.append(plain[at:at + p.data.nbytes].view(p.data.dtype))
        at += p.data.nbytes

    def host_copy() -> None:
        for v, p in zip(views, pieces, strict=True):
            np.copyto(v, p.data)

    def agreement_and_layout(path: str) -> None:
        plan = agree_on_arguments(path, tensors, pieces, {"step": 1}, None, None, comm, comm)
        tmp, _, _ = name_temp_file(path, base, comm)
        layout_posix(tmp, plan.names, plan.infos, plan.plain, comm)
        comm.Barrier()
        if comm.rank == 0:
            os.remove(tmp)

    def start(path: str) -> Any:
        return save_checkpoint(path, tensors, pieces, {"step": 1}, comm=comm, async_=True)

    start(os.path.join(base, "warm.h5")).wait()  # the pool is allocated once
    rows: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        path = os.path.join(base, f"async-{rep}.h5")
        t_copy = timed(comm, host_copy)
        t_phases = timed(comm, lambda path=path: agreement_and_layout(path))
        t_async, h = timed_call(comm, lambda path=path: start(path))
        h.wait()
        comm.Barrier()
        if comm.rank == 0:
            os.remove(path)
        for k, v in (("async save (blocking part)", t_async), ("plain host copy", t_copy),
                     ("agreement + layout", t_phases), ("reference", t_copy + t_phases),
                     ("snapshot (rank max)", _max(comm, h.phase_seconds["snapshot"]))):
            rows.setdefault(k, []).append(v)
    if comm.rank != 0:
        return {}
    os.remove(os.path.join(base, "warm.h5"))
    med = {k: _median(v) for k, v in rows.items()}
    ratio = med["async save (blocking part)"] / med["reference"]
    print(f"\nasynchronous save, blocking part: {comm.size} rank(s), "
          f"{sum(i.nbytes for i in tensors.values()) / 1e9:.3f} GB, median of {args.repeats}")
    for k, v in med.items():
        print(f"  {k:<28} {v:8.3f} s")
    print(f"  async blocking / (host copy + agreement + layout) {ratio:5.2f}x  (goal <= 1.2)")
    return {"seconds": rows, "ratio": ratio}


def _gpt_config(out: str, total_bytes: float, size: int, steps: int) -> Any:
    """A GPT whose float32 parameters and two AdamW moments are about ``total_bytes``."""
    from mpidist.run.config import TrainConfig

    params = total_bytes / 12
    n_layer = 4
    n_embd = max(32, int(round((params / (12 * n_layer)) ** 0.5 / 32)) * 32)
    return TrainConfig(out=out, strategy="ddp", n_layer=n_layer, n_head=4, n_embd=n_embd,
                       block_size=16, global_batch=2 * size, steps=steps, dtype="float32",
                       eval_interval=0, progress=False)


def window_section(comm, args, base: str) -> dict:
    """K training steps without a save, with an asynchronous one, with a blocking one."""
    from mpidist.data import GlobalBatchSampler
    from mpidist.run.build import make_data, make_model, make_strategy

    k = args.window_steps
    cfg = _gpt_config(base, args.size_mb * 1e6, comm.size, 10**6)
    opt = make_strategy(cfg, comm)
    model = opt.wrap(make_model(cfg), seed=0)
    data, _ = make_data(cfg)
    opt.sampler = sampler = GlobalBatchSampler(len(data), cfg.global_batch, seed=0)

    def step() -> float:
        t0 = time.perf_counter()
        opt.step(model, data.batch(sampler.next_local(model.dp_rank, model.dp_size)))
        return time.perf_counter() - t0

    def steps(n: int, writing: Any = None, out: Any = None) -> None:
        for _ in range(n):
            busy = writing is not None and not writing.done()
            dt = step()
            if out is not None:
                out.setdefault("writing" if busy else "idle", []).append(dt)

    steps(2)  # compiled and warm
    path = os.path.join(base, "window.h5")
    opt.save(path, async_=True).wait()  # the pool is allocated once
    rows: dict[str, list[float]] = {}
    per_step: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        if comm.rank == 0 and os.path.exists(path):
            os.remove(path)
        rows.setdefault("no save", []).append(timed(comm, lambda: steps(k, out={})))
        def with_async() -> Any:
            handle = opt.save(path, async_=True)
            steps(k, handle, per_step)
            handle.wait(opt.step_count)  # if no step committed it
            return handle

        t_window, h = timed_call(comm, with_async)
        rows.setdefault("async save", []).append(t_window)
        rows.setdefault("async: blocking part", []).append(_max(comm, h.blocking_seconds))
        rows.setdefault("async: background write", []).append(_max(comm, h.background_seconds))
        rows.setdefault("async: committed at step", []).append(
            float(h.commit_step - (opt.step_count - k)))
        comm.Barrier()
        if comm.rank == 0:
            os.remove(path)
        t_save = timed(comm, lambda: opt.save(path))
        rows.setdefault("blocking save", []).append(t_save + timed(comm, lambda: steps(k)))
        rows.setdefault("blocking: the save", []).append(t_save)
    plain_steps = comm.gather(rows["no save"], root=0)
    writing = comm.gather(per_step.get("writing", []), root=0)
    if comm.rank != 0:
        return {}
    nbytes = os.path.getsize(path)
    med = {key: _median(v) for key, v in rows.items()}
    over = med["async save"] - med["no save"]
    goal = 0.25 * med["blocking: the save"]
    step_writing = _median([x for w in writing for x in w])
    step_plain = _median([x for w in plain_steps for x in w]) / k
    print(f"\na window of {k} training steps (GPT {cfg.n_layer}x{cfg.n_embd}, ddp, AdamW, "
          f"float32; checkpoint {nbytes / 1e9:.3f} GB) on {comm.size} rank(s), median of "
          f"{args.repeats}, variants interleaved")
    for key, v in med.items():
        unit = "" if key.endswith("step") else " s"
        print(f"  {key:<28} {v:8.3f}{unit}")
    print(f"  async window - plain window      {over:8.3f} s   goal <= 25% of a blocking "
          f"save = {goal:.3f} s: {'met' if over <= goal else 'NOT met'}")
    print(f"  background write while training  {nbytes / med['async: background write'] / 1e9:8.3f}"
          f" GB/s   blocking save {nbytes / med['blocking: the save'] / 1e9:.3f} GB/s")
    print(f"  step while the writer runs       {step_writing:8.3f} s   without a save "
          f"{step_plain:.3f} s ({step_writing / step_plain:.2f}x)")
    return {"seconds": rows, "bytes": nbytes, "overhead": over, "goal": goal,
            "step_writing": step_writing, "step_plain": step_plain}


def torch_section(comm, args, base: str) -> dict:
    """mpidist's asynchronous HDF5 save of a torch model against torch DCP's async_save,
    blocking time, over the "mpidist" process group."""
    try:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
    except ImportError:
        if comm.rank == 0:
            print("\ntorch section skipped: torch is not installed")
        return {}
    import mpidist.torch as mt

    if not dist.is_initialized():
        dist.init_process_group("mpidist")
    torch.manual_seed(0)
    width = max(16, int((args.size_mb * 1e6 / 12 / 8) ** 0.5))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    mt.save_checkpoint(os.path.join(base, "torch-warm.h5"), model, opt, async_=True).wait()
    rows: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        t, handle = timed_call(comm, lambda rep=rep: mt.save_checkpoint(
            os.path.join(base, f"torch-{rep}.h5"), model, opt, async_=True))
        rows.setdefault("mpidist async_ (HDF5)", []).append(t)
        handle.wait()
        t, future = timed_call(comm, lambda rep=rep: dcp.async_save(
            {"model": model.state_dict(), "optim": opt.state_dict()},
            checkpoint_id=os.path.join(base, f"dcp-{rep}")))
        rows.setdefault("torch DCP async_save", []).append(t)
        future.result()
        comm.Barrier()
    if comm.rank != 0:
        return {}
    med = {k: _median(v) for k, v in rows.items()}
    nbytes = os.path.getsize(os.path.join(base, "torch-0.h5"))
    print(f"\ntorch model ({nbytes / 1e9:.3f} GB of parameters and AdamW state) on "
          f"{comm.size} rank(s), blocking part of an asynchronous save, median of "
          f"{args.repeats}")
    for k, v in med.items():
        print(f"  {k:<28} {v:8.3f} s")
    ratio = med["mpidist async_ (HDF5)"] / med["torch DCP async_save"]
    print(f"  mpidist / torch DCP              {ratio:5.2f}x")
    return {"seconds": rows, "ratio": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=1024.0, help="total state in MB")
    ap.add_argument("--tensors", type=int, default=300, help="number of tensors")
    ap.add_argument("--dir", default=None, help="directory on the file system to test "
                    "(default: the system temp directory)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="repetitions; the best and the median are shown")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--sections", default="io,async,window,torch",
                    help="comma-separated: io, async, window, torch (skipped without torch)")
    ap.add_argument("--window-steps", type=int, default=6,
                    help="training steps in each window of the window section")
    args = ap.parse_args()
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = sorted(set(sections) - {"io", "async", "window", "torch"})
    if unknown:
        raise SystemExit(f"--sections: unknown {unknown}")

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    units = make_units(int(args.size_mb * 1e6), args.tensors)
    layout = ShardedLayout(units, size, rank)
    tensors = {name: TensorInfo(tuple(shape), "float32") for u in units for name, shape in u}
    local = np.random.default_rng(rank).standard_normal(layout.local_size).astype(np.float32)
    pieces = [Piece(n, flat, local[loc]) for n, flat, loc in layout.local_pieces()]

    base = tempfile.mkdtemp(prefix="mpidist-bench-ckpt-", dir=args.dir) if rank == 0 else None
    base = comm.bcast(base, root=0)
    results: dict = {"world_size": size, "bytes": sum(i.nbytes for i in tensors.values()),
                     "tensors": len(tensors)}
    try:
        if "io" in sections:
            results["io"] = io_section(comm, args, base, tensors, pieces)
        if "async" in sections:
            results["async"] = async_section(comm, args, base, tensors, pieces)
        if "window" in sections:
            results["window"] = window_section(comm, args, base)
        if "torch" in sections:
            results["torch"] = torch_section(comm, args, base)
    finally:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
