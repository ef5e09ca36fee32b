"""Communication-efficient training next to DDP: bytes sent, sync time and validation loss.

Usage::

    mpiexec -n 2 python benchmarks/compression.py [--steps 60] [--global-batch 32]
    mpiexec -n 4 python benchmarks/compression.py

Trains the same small GPT (TextCorpus, AdamW, float32) for the same number of steps with
DDP and with each communication-efficient strategy, and prints one table: gradient/parameter
bytes this rank handed to MPI per step (measured by a CountingComm proxy on the exchange
path, not computed), the ratio to DDP's, the blocking sync time per step (time waiting for
exchanges after backward; overlapped time is not included), and the validation loss after
the last step (async flushed, Local SGD averaged first) relative to DDP's.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpidist.core.mesh import ProcessMesh
from mpidist.data import TextCorpus
from mpidist.nn import GPT, CrossEntropyLoss, GPTConfig
from mpidist.optim import AdamW
from mpidist.parallel import (
    AllReduce,
    AsyncSGDOptimizer,
    DDPOptimizer,
    GradientCompressionOptimizer,
    LocalSGDOptimizer,
    ShardingConfiguration,
)


class MeteredAllReduce(AllReduce):
    """DDP's gradient exchange (bucketed allreduce) with its bytes counted the way the
    communication-efficient hooks count theirs: :meth:`~mpidist.parallel.hooks.GradientHook.bind`
    puts a :class:`~mpidist.parallel.CountingComm` over the hook's communicator, and
    ``bytes_sent`` reads it. The library does not meter DDP itself (no proxy on its path)."""

    metered = True


def variants() -> list[tuple[str, object]]:
    def gc(method: str, **kw: object):
        return lambda b, c, l: GradientCompressionOptimizer(b, c, method=method, loss=l, **kw)

    return [
        ("ddp", lambda b, c, l: DDPOptimizer(b, c, loss=l, hook=MeteredAllReduce())),
        ("none", gc("none")),
        ("fp16", gc("fp16")),
        ("bf16", gc("bf16")),
        ("topk 10%", gc("topk", ratio=0.1)),
        ("topk 1%", gc("topk", ratio=0.01)),
        ("powersgd r=4", gc("powersgd", rank=4)),
        ("powersgd r=1", gc("powersgd", rank=1)),
        ("local H=4", lambda b, c, l: LocalSGDOptimizer(b, c, sync_every=4, loss=l)),
        ("local H=16", lambda b, c, l: LocalSGDOptimizer(b, c, sync_every=16, loss=l)),
        ("async s=1", lambda b, c, l: AsyncSGDOptimizer(b, c, staleness=1, loss=l)),
        ("async s=2", lambda b, c, l: AsyncSGDOptimizer(b, c, staleness=2, loss=l)),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--bucket-mb", type=float, default=0.05)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    cfg_gpt = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer,
                        n_head=2, n_embd=args.n_embd)
    data = TextCorpus(args.block_size)
    val = TextCorpus(args.block_size, split="validation")
    xv, yv = val.batch(np.linspace(0, len(val) - 1, 512).astype(np.int64))
    loss = CrossEntropyLoss()
    rows = []
    for name, factory in variants():
        config = ShardingConfiguration(mesh=ProcessMesh(comm), dtype="float32",
                                       bucket_mb=args.bucket_mb)
        opt = factory(AdamW(lr=args.lr, weight_decay=0.1), config, loss)
        model = opt.wrap(GPT(cfg_gpt), seed=0)
        opt.optimize(model, data, 2, global_batch_size=args.global_batch)  # warm-up (JIT)
        before = opt.bytes_sent
        comm_t0 = opt.timers["communication"]
        comm.Barrier()
        t0 = time.perf_counter()
        opt.optimize(model, data, args.steps, global_batch_size=args.global_batch)
        seconds = time.perf_counter() - t0
        after = opt.bytes_sent
        if isinstance(opt, AsyncSGDOptimizer):
            opt.flush()
        if isinstance(opt, LocalSGDOptimizer):
            opt.average_replicas()
        sync = (opt.timers["communication"] - comm_t0) / args.steps
        vloss = loss.forward(model.forward(xv), yv)
        rows.append((name, (after - before) / args.steps, sync, seconds / args.steps, vloss))
    if comm.Get_rank() == 0:
        ddp_bytes, ddp_val = rows[0][1], rows[0][4]
        n_params = sum(int(np.prod(s)) for _, s in GPT(cfg_gpt).named_parameter_shapes())
        print(f"ranks={comm.Get_size()} params={n_params} steps={args.steps} "
              f"global_batch={args.global_batch} AdamW lr={args.lr} float32")
        print(f"{'strategy':14s} {'bytes/step':>11s} {'vs DDP':>7s} {'sync ms/step':>12s} "
              f"{'step ms':>8s} {'val loss':>9s} {'vs DDP':>8s}")
        for name, b, sync, step, v in rows:
            ratio = f"{b / ddp_bytes:7.3f}" if ddp_bytes else f"{'-':>7s}"  # 1 rank: no bytes
            print(f"{name:14s} {b:11.0f} {ratio} {sync * 1e3:12.3f} "
                  f"{step * 1e3:8.2f} {v:9.4f} {v / ddp_val - 1:+8.2%}")
        # The check of the meter: DDP allreduces every float32 gradient once a step.
        print(f"DDP bytes/step = {ddp_bytes / (4 * n_params):.3f} x 4 bytes x params"
              + (" (1 rank: nothing to exchange)" if comm.Get_size() == 1 else ""))


if __name__ == "__main__":
    main()
