"""Small torch models and helpers shared by the mpidist.torch tests."""

from __future__ import annotations

import datetime
import gc
import os
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

VOCAB, BLOCK, EMBD, HEADS, LAYERS = 29, 8, 16, 2, 2


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(EMBD)
        self.attn = torch.nn.MultiheadAttention(EMBD, HEADS, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(EMBD)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(EMBD, 3 * EMBD), torch.nn.GELU(),
                                       torch.nn.Linear(3 * EMBD, EMBD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    """A GPT whose output embedding is tied to the input one; forward returns (logits, loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, EMBD)
        self.wpe = torch.nn.Embedding(BLOCK, EMBD)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(EMBD)
        self.head = torch.nn.Linear(EMBD, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1),
                                   reduction="sum")
        return logits, loss


class BNNet(torch.nn.Module):
    """BatchNorm buffers, an unused parameter and a dict output."""

    def __init__(self, d_in: int = 6, classes: int = 5) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, 12, bias=False)  # BatchNorm cancels a bias
        self.bn = torch.nn.BatchNorm1d(12)
        self.fc2 = torch.nn.Linear(12, classes)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.bn(self.fc1(x)))
        return {"logits": self.fc2(h), "hidden": h}


class MLPBlock(torch.nn.Module):
    """A residual MLP block whose two linears take a column / row tensor-parallel plan."""

    def __init__(self, d: int = 6, hidden: int = 24) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class MLP(torch.nn.Module):
    def __init__(self, d: int = 6, classes: int = 5, depth: int = 2) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(MLPBlock(d) for _ in range(depth))
        self.head = torch.nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Chain(torch.nn.Module):
    """``stages`` small stages run one after the other (a model cut for a pipeline)."""

    def __init__(self, stages: int, d: int = 6, classes: int = 5) -> None:
        super().__init__()
        layers = []
        for s in range(stages):
            parts = [torch.nn.Linear(d, d), torch.nn.Tanh()]
            if s == stages - 1:
                parts.append(torch.nn.Linear(d, classes))
            layers.append(torch.nn.Sequential(*parts))
        self.stages = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return x


def make_mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP().double()


def make_chain(stages: int, seed: int = 0) -> Chain:
    torch.manual_seed(seed)
    return Chain(stages).double()


def tp_fsdp_mlp(dp: int, tp: int):
    """The MLP (``make_mlp``) on a (dp, tp) DeviceMesh: each block's linears split column-
    and row-wise over tp, the head column-wise with a replicated output (so every parameter
    lives on the 2-D mesh, as clipping needs), FSDP2 over dp. Returns (model, mesh).
    Collective over every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = make_mlp()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(),
                                               "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    parallelize_module(model.head, mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def make(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = TinyGPT() if kind == "gpt" else BNNet()
    return model.double()


def batch(kind: str, step: int, global_batch: int):
    """The global batch of a step (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "gpt":
        idx = torch.randint(0, VOCAB, (global_batch, BLOCK + 1), generator=g)
        return idx[:, :-1], idx[:, 1:]
    x = torch.randn(global_batch, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (global_batch,), generator=g)
    return x, y


def local(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    b = t.shape[0] // size
    return t[rank * b:(rank + 1) * b]


def loss_of(kind: str, model: torch.nn.Module, x: torch.Tensor,
            y: torch.Tensor) -> torch.Tensor:
    """The mean loss over the local batch (the average over ranks is the global mean)."""
    if kind == "gpt":
        _, loss = model(x, y)
        return loss / y.numel()
    out = model(x)
    return F.cross_entropy(out["logits"], y) + 0.0 * out["hidden"].sum()


def params_of(model: torch.nn.Module, comm=None) -> dict[str, np.ndarray]:
    """The model's parameters as global arrays: DTensors gathered, and the rows of
    ``mpidist.torch.fully_shard``'s shards gathered over ``comm`` (collective then)."""
    out = {}
    for name, p in model.named_parameters():
        info = getattr(p, "_mpidist_shard", None)
        if info is not None:
            rows = comm.allgather(p.detach().numpy().reshape(-1).copy())
            out[name] = np.concatenate(rows).reshape(info.shape)
        else:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = t.detach().numpy().copy()
    return out


def assert_close(a: dict[str, np.ndarray], b: dict[str, np.ndarray], rtol: float = 1e-10,
                 what: str = "") -> None:
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    for k in a:
        scale = max(1.0, float(np.abs(b[k]).max()) if b[k].size else 1.0)
        err = float(np.abs(a[k] - b[k]).max()) if a[k].size else 0.0
        assert err <= rtol * scale, f"{what} {k}: max error {err:.3e}"


def gloo(comm) -> None:
    """torch.distributed's default group on the gloo backend over the MPI ranks."""
    use_backend("gloo", comm)


def use_backend(name: str, comm) -> None:
    """Make torch.distributed's default group one of backend ``name`` ("gloo" or "mpidist")
    over the MPI ranks, destroying a default group of another backend first. Collective."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_backend() == name:
            return
        # gloo's groups close their connections with their peers when they are freed: free
        # them everywhere at the same point, not whenever each rank's garbage collector runs.
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
        comm.Barrier()
    if name == "mpidist":
        import mpidist.torch  # noqa: F401 - registers the backend

        # A test that hangs ends with the watchdog's report of where, well before pytest's
        # per-test timeout.
        dist.init_process_group("mpidist", timeout=datetime.timedelta(seconds=120))
        return
    path = tempfile.mkdtemp(prefix="mpidist-gloo-") if comm.Get_rank() == 0 else None
    path = comm.bcast(path, root=0)
    dist.init_process_group(name, init_method=f"file://{os.path.join(path, 'rendezvous')}",
                            rank=comm.Get_rank(), world_size=comm.Get_size())
