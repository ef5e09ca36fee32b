"""The multi-rank part of the GPU check (``benchmarks/gpu_check.py``), run by it under
``mpiexec -n 1`` and ``-n 2``: torch training with device tensors through mpidist.torch's
wrappers and through torch's own DDP and FSDP2 on the "mpidist" backend, each against
single-process training on the same global batch (float64, 1e-10), and a checkpoint round
trip of device state. Rank 0 prints one JSON line per check."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import traceback
import warnings

import torch
from mpi4py import MPI

import mpidist.torch as mt
from mpidist.torch.optim import AdamW as FusedAdamW

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
STEPS, BATCH = 4, 8


def model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.GELU(), torch.nn.Linear(24, 24),
                               torch.nn.GELU(), torch.nn.Linear(24, 5)).double().to(device)


def batch(step: int, device: str, local: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH * SIZE, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (BATCH * SIZE,), generator=g)
    if local:
        x, y = x[RANK * BATCH:(RANK + 1) * BATCH], y[RANK * BATCH:(RANK + 1) * BATCH]
    return x.to(device), y.to(device)


def train(net: torch.nn.Module, opt: torch.optim.Optimizer, device: str, local: bool) -> None:
    for step in range(STEPS):
        x, y = batch(step, device, local)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


def full(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in m.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("module.", "")] = t.detach().cpu()
    return out


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str:
    err = max(float((got[k] - want[k]).abs().max()) for k in want)
    if not err <= 1e-10:
        raise AssertionError(f"max difference {err:.2e} from single-process training")
    return f"max diff {err:.1e}"


def reference(device: str) -> dict[str, torch.Tensor]:
    net = model(device)
    train(net, torch.optim.AdamW(net.parameters(), lr=1e-2), device, local=False)
    return full(net)


def wrappers(device: str, want: dict) -> dict[str, tuple]:
    """mpidist.torch's own DDP, ZeroRedundancyOptimizer (with the fused AdamW) and
    fully_shard; returns the ZeRO model and optimizer for the checkpoint check."""
    out = {}
    net = mt.DistributedDataParallel(model(device))
    train(net, torch.optim.AdamW(net.parameters(), lr=1e-2), device, True)
    out["mpidist DDP"] = compare(full(net), want)
    net = mt.DistributedDataParallel(model(device))
    opt = mt.ZeroRedundancyOptimizer(net.parameters(), FusedAdamW, lr=1e-2)
    train(net, opt, device, True)
    out["mpidist ZeRO + fused AdamW"] = compare(full(net), want)
    out["_zero"] = (net, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        shard = mt.fully_shard(model(device))
    train(shard, torch.optim.AdamW(shard.parameters(), lr=1e-2), device, True)
    out["mpidist fully_shard"] = compare(gathered(shard, want), want)
    return out


def gathered(shard: torch.nn.Module, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full parameters of a model sharded by mpidist's fully_shard: each rank holds
    rows of dimension 0, in rank order."""
    out = {}
    for name, p in shard.named_parameters():
        rows = COMM.allgather(p.detach().cpu().reshape(-1))
        out[name] = torch.cat(rows).reshape(like[name].shape)
    return out


def backend(device: str, want: dict) -> dict[str, str]:
    """torch's DDP and FSDP2 on the "mpidist" backend."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("mpidist")
    out = {}
    ids = [torch.cuda.current_device()] if device == "cuda" else None
    net = DistributedDataParallel(model(device), device_ids=ids)
    train(net, torch.optim.AdamW(net.parameters(), lr=1e-2), device, True)
    out["backend DDP"] = compare(full(net), want)
    net = model(device)
    mesh = init_device_mesh(device, (SIZE,))
    for layer in net:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    train(net, FusedAdamW(net.parameters(), lr=1e-2), device, True)
    out["backend FSDP2 + fused AdamW"] = compare(full(net), want)
    dist.destroy_process_group()
    return out


def checkpoint(device: str, net: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    # the default posix write path needs no h5py built with MPI (rank 0 lays the file out)
    path = COMM.bcast(tempfile.mkdtemp(prefix="gpu-check-") if RANK == 0 else None)
    mt.save_checkpoint(os.path.join(path, "ckpt.h5"), net, opt)
    again = mt.DistributedDataParallel(model(device))
    opt2 = mt.ZeroRedundancyOptimizer(again.parameters(), FusedAdamW, lr=1e-2)
    mt.load_checkpoint(os.path.join(path, "ckpt.h5"), again, opt2)
    for m, o in ((net, opt), (again, opt2)):
        x, y = batch(STEPS, device, True)
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        o.step()
    a, b = full(net), full(again)
    err = max(float((a[k] - b[k]).abs().max()) for k in a)
    if err != 0.0:
        raise AssertionError(f"a step after the round trip differs by {err:.2e}")
    return "saved, loaded into a new model, next step identical"


def report(what: str, status: str, detail: str = "") -> None:
    if RANK == 0:
        print(json.dumps({"what": what, "status": status, "detail": detail}), flush=True)


def run(what: str, fn, *a) -> object:
    try:
        result = fn(*a)
    except Exception as e:  # each check reports, the others still run
        msg = str(e)
        if msg.startswith("SKIP: "):
            report(what, "SKIP", msg[6:])
        else:
            report(what, "FAIL", f"{type(e).__name__}: {msg}")
            if RANK == 0:
                traceback.print_exc()
        return None
    if isinstance(result, dict):
        for k, v in result.items():
            if not k.startswith("_"):
                report(k, "PASS", v)
    else:
        report(what, "PASS", str(result))
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default=".")
    args = p.parse_args()
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", RANK)) % torch.cuda.device_count())
    torch.set_num_threads(1)
    want = reference(device)
    got = run("mpidist wrappers", wrappers, device, want)
    run("backend", backend, device, want)
    if got:
        net, opt = got["_zero"]
        run("checkpoint of device state", checkpoint, device, net, opt)


if __name__ == "__main__":
    main()
