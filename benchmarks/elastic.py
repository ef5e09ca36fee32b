"""Elastic resizing in memory vs through a checkpoint, in one run.

    mpiexec -n 4 python benchmarks/elastic.py [--strategy zero3] [--n-layer 4 --n-embd 192]

On N workers with a GPT and AdamW state after one step, times:

* scale-down N -> N-1 in memory (the last worker leaves; its shards move by Alltoallv);
* scale-up N-1 -> N in memory (one worker spawned and merged; shards move by Alltoallv),
  with the spawn and the redistribution shown apart;
* saving and loading a checkpoint of the same state (``save_training``/``load_training``,
  parallel HDF5) on N workers: what a restart from disk costs on top of relaunching.

The spawned worker runs this same script; it joins inside ``opt.wrap``. Rank 0 prints the
table and the ratio of the checkpoint round trip to the in-memory redistribution.
"""

from __future__ import annotations

import argparse
import shutil
import time

import numpy as np
from mpi4py import MPI

from mpidist.checkpoint.training import load_training, save_training
from mpidist.data import GlobalBatchSampler, TextCorpus
from mpidist.nn import GPT, GPTConfig
from mpidist.optim import AdamW
from mpidist.parallel import ShardingConfiguration
from mpidist.parallel.elastic import ElasticOptimizer


def _max(comm, value: float) -> float:
    buf = np.array([value])
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return float(buf[0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="zero3")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=192)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--dir", default="runs/bench-elastic",
                   help="checkpoint directory (removed afterwards)")
    args = p.parse_args()

    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=args.n_layer, n_head=4,
                    n_embd=args.n_embd)
    joiner = ElasticOptimizer.is_joiner()
    opt = ElasticOptimizer(AdamW(lr=1e-3), ShardingConfiguration(dtype=args.dtype),
                           min_workers=1, max_workers=64, strategy=args.strategy)
    model = opt.wrap(GPT(cfg), seed=0)
    data = TextCorpus(cfg.block_size)
    rows: list[tuple[str, float, str]] = []
    # The global batch divides by N and N-1; a joiner makes the same sampler (and gets
    # the data position of the job), as every worker must for checkpoints to agree.
    n = opt.current_workers
    opt.sampler = GlobalBatchSampler(len(data), 12 * n * (n - 1), seed=0)
    if not joiner:
        comm = opt.comm
        n = comm.Get_size()
        if n < 2:
            raise SystemExit("run under mpiexec -n 2 or more")
        x, y = data.batch(opt.sampler.next_local(model.dp_rank, model.dp_size))
        opt.step(model, (x, y))
        # One copy of the parameters and of each optimizer-state tensor (what a checkpoint
        # holds), whatever the strategy replicates.
        mb = model.layout.numel * model.dtype.itemsize * (1 + len(opt.state.buffers)) / 2**20

        comm.Barrier()
        if comm.Get_rank() == n - 1:
            opt.request_leave()
        t0 = time.perf_counter()
        model = opt.maybe_rescale(model)
        if model is None:
            return  # the worker that left
        comm = opt.comm
        down = _max(comm, time.perf_counter() - t0)
        rows.append((f"scale-down {n} -> {n - 1}, in memory", down,
                     f"{_max(comm, opt.last_timing['redistribute']):.4f} s Alltoallv"))

        comm.Barrier()
        if comm.Get_rank() == 0:
            opt.scale_to(n)
        t0 = time.perf_counter()
        model = opt.maybe_rescale(model)
        up = time.perf_counter() - t0
        t = opt.last_timing
        rows.append((f"scale-up {n - 1} -> {n}, in memory (total)", up, ""))
        rows.append(("  of which Spawn + Merge", t["spawn"], ""))
        rows.append(("  of which rebuild + Alltoallv", t["rebuild"] + t["redistribute"],
                     f"{t['redistribute']:.4f} s Alltoallv"))
    comm = opt.comm
    rank = comm.Get_rank()
    directory = args.dir
    saves, loads = [], []
    for rep in range(3):
        comm.Barrier()
        t0 = time.perf_counter()
        path = save_training(directory, opt, step=rep, keep=1, comm=comm)
        saves.append(_max(comm, time.perf_counter() - t0))
        comm.Barrier()
        t0 = time.perf_counter()
        load_training(path, opt, comm=comm)
        loads.append(_max(comm, time.perf_counter() - t0))
    if rank == 0 and not joiner:
        n = comm.Get_size()
        rows.append((f"checkpoint save on {n} (best of 3)", min(saves), ""))
        rows.append((f"checkpoint load on {n} (best of 3)", min(loads), ""))
        print(f"\nelastic resize vs checkpoint: {args.strategy}, GPT {args.n_layer}x{args.n_embd}"
              f", {args.dtype}, AdamW; parameters + optimizer state {mb:.1f} MiB (one copy)")
        print(f"{'operation':<44}{'seconds':>10}  note")
        for name, sec, note in rows:
            print(f"{name:<44}{sec:>10.4f}  {note}")
        disk = min(saves) + min(loads)
        mem = down
        print(f"\ncheckpoint save+load / in-memory scale-down: {disk / mem:.1f}x; "
              f"/ in-memory scale-up without the spawn: "
              f"{disk / (t['rebuild'] + t['redistribute']):.1f}x")
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    opt.free()


if __name__ == "__main__":
    main()
