"""The two models the torch benchmarks train (vs_torch.py, torch_backend.py): a small GPT
(0.83 M parameters, compute dominates) and an MLP (3.48 M parameters, gradients dominate),
with the global batch of each step, the same at every world size."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

VOCAB, BLOCK, EMBD, HEADS, LAYERS = 256, 64, 128, 4, 4


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(EMBD), torch.nn.LayerNorm(EMBD)
        self.qkv = torch.nn.Linear(EMBD, 3 * EMBD)
        self.proj = torch.nn.Linear(EMBD, EMBD)
        self.fc, self.out = torch.nn.Linear(EMBD, 4 * EMBD), torch.nn.Linear(4 * EMBD, EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(EMBD, dim=2)
        q, k, v = (z.view(b, t, HEADS, EMBD // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, EMBD))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, EMBD), torch.nn.Embedding(BLOCK, EMBD)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(EMBD)
        self.head = torch.nn.Linear(EMBD, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class MLP(torch.nn.Module):
    def __init__(self, d_in: int = 256, width: int = 1024, depth: int = 4,
                 classes: int = 64) -> None:
        super().__init__()
        dims = [d_in] + [width] * depth
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(a, b),
                                                              torch.nn.GELU())
                                          for a, b in zip(dims[:-1], dims[1:], strict=True))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT() if name == "transformer" else MLP()


def local_batch(name: str, gb: int, step: int, rank: int,
                size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s slice of the global batch of ``step`` (``gb`` samples)."""
    g = torch.Generator().manual_seed(1000 + step)
    b = gb // size
    if name == "transformer":
        idx = torch.randint(0, VOCAB, (gb, BLOCK + 1), generator=g)[rank * b:(rank + 1) * b]
        return idx[:, :-1], idx[:, 1:]
    x = torch.randn(gb, 256, generator=g)[rank * b:(rank + 1) * b]
    return x, torch.randint(0, 64, (gb,), generator=g)[rank * b:(rank + 1) * b]


def timed_steps(net: torch.nn.Module, opt: torch.optim.Optimizer, name: str, gb: int,
                steps: int, comm) -> tuple[list[float], list[float]]:
    """2 warm-up and ``steps`` timed training steps: the slowest rank's seconds of each timed
    step and the mean loss of every step. Collective over ``comm`` (an mpi4py communicator)."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    times, losses = [], []
    for s in range(2 + steps):
        x, y = local_batch(name, gb, s, rank, size)
        comm.Barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        out = net(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if s >= 2:
            times.append(float(comm.allreduce(dt, op=MPI.MAX)))
        losses.append(float(comm.allreduce(loss.item())) / size)
    return times, losses
