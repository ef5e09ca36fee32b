"""A plain PyTorch training script on MPI with mpidist.torch: only the imports change.

Train a small transformer language model on the byte-level corpus that ships with mpidist,
on 4 ranks with fully_shard (FSDP2 style), checkpoint it, then resume on 2 ranks with
DistributedDataParallel, or unwrapped in one process::

    mpiexec -n 4 python examples/torch_transformer.py --wrapper fsdp --steps 60
    mpiexec -n 2 python examples/torch_transformer.py --wrapper ddp --steps 120 --resume
    python examples/torch_transformer.py --wrapper none --steps 140 --resume

The global batch is fixed (``--global-batch``), each rank takes its slice of it, so the
same steps give the same losses at any world size.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F

# The three lines a torch script changes: torch.distributed, DDP/ZeRO and fully_shard come
# from mpidist.torch (MPI underneath; no rendezvous variables, launched by mpiexec or srun).
import mpidist.torch.distributed as dist
from mpidist.data import TextCorpus
from mpidist.torch import (
    DistributedDataParallel,
    ZeroRedundancyOptimizer,
    fully_shard,
    load_checkpoint,
    save_checkpoint,
)


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class LM(torch.nn.Module):
    def __init__(self, vocab: int = 256, block: int = 64, d: int = 128, heads: int = 4,
                 layers: int = 4) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, d), torch.nn.Embedding(block, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied embeddings

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1),
                                                            targets.flatten())
        return logits, loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wrapper", choices=("ddp", "zero", "fsdp", "none"), default="ddp")
    p.add_argument("--steps", type=int, default=60, help="train until this step")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint-interval", type=int, default=20)
    p.add_argument("--out", default="runs/torch-example")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()

    dist.init_process_group("mpi")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch={args.global_batch} must divide by {world} ranks")
    torch.manual_seed(0)
    model = LM()
    net: torch.nn.Module = model
    if args.wrapper in ("ddp", "zero"):
        net = DistributedDataParallel(model)
    elif args.wrapper == "fsdp":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    if args.wrapper == "zero":
        opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=args.lr)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=args.lr)

    step = 0
    if args.resume and os.path.exists(os.path.join(args.out, "latest")):
        step = int(load_checkpoint(args.out, net, opt)["step"])
        if rank == 0:
            print(f"resumed at step {step} from {args.out} on {world} rank(s)")
    if step >= args.steps:
        if rank == 0:
            print(f"{args.out} is at step {step} and --steps is {args.steps}: nothing to do")
        dist.destroy_process_group()
        return

    corpus = TextCorpus(64)
    b = args.global_batch // world
    t0 = time.perf_counter()
    while step < args.steps:
        # The global batch of a step depends on the step only; each rank takes its slice.
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(len(corpus), (args.global_batch,), generator=g)[rank * b:][:b]
        x, y = (torch.from_numpy(a).long() for a in corpus.batch(ids.numpy()))
        opt.zero_grad()
        _, loss = net(x, y)
        loss.backward()
        opt.step()
        step += 1
        mean = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(mean)
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            print(f"step {step:5d}  loss {mean.item() / world:.4f}  "
                  f"({(time.perf_counter() - t0) / 10 * 1e3:.0f} ms/step)", flush=True)
            t0 = time.perf_counter()
        if step % args.checkpoint_interval == 0 or step == args.steps:
            path = save_checkpoint(os.path.join(args.out, f"ckpt-{step:08d}.h5"), net, opt,
                                   step=step, keep=3)
            if rank == 0:
                print(f"saved {path}")
    if rank == 0:
        print(f"done: loss {mean.item() / world:.4f} vs uniform {math.log(256):.4f} nats/byte")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
