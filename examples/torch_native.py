"""torch's own parallel stack on MPI: the script changes one line (``import mpidist.torch``)
and its launcher (mpiexec or srun instead of torchrun).

Train the small transformer of ``torch_transformer.py`` with torch's own DDP, FSDP2
(``fully_shard``) or tensor parallelism + FSDP2 on a 2-D DeviceMesh, save
``torch.distributed.checkpoint`` checkpoints, and resume at another world size or
parallelism (DCP reshards on load)::

    mpiexec -n 4 python examples/torch_native.py --parallel fsdp --steps 40
    mpiexec -n 2 python examples/torch_native.py --parallel ddp --steps 60 --resume
    mpiexec -n 4 python examples/torch_native.py --parallel tp --steps 80 --resume
    srun --mpi=pmix python examples/torch_native.py --parallel fsdp      # in a Slurm job

The global batch is fixed (``--global-batch``) and each data-parallel rank takes its slice,
so the same steps give the same losses at any world size.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch_transformer import LM

import mpidist.torch  # noqa: F401 - the one added line: registers the "mpidist" backend
from mpidist.data import TextCorpus


def parallelize(model: LM, how: str, world: int) -> tuple[torch.nn.Module, int, int]:
    """The model wrapped as asked; returns it, the data-parallel size and this rank's
    data-parallel index."""
    if how == "ddp":
        return DistributedDataParallel(model), world, dist.get_rank()
    if how == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, world, dist.get_rank()
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = 2 if world % 2 == 0 else 1
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    plan = {"fc": ColwiseParallel(), "out": RowwiseParallel()}  # the MLP of each block
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, world // tp, mesh["dp"].get_local_rank()


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ for parameters that live on different meshes (with tp, the
    blocks' on the 2-D mesh, the embeddings' on the data-parallel one): one norm per mesh,
    made whole, then combined. Collective."""
    groups: dict[int, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parallel", choices=("ddp", "fsdp", "tp"), default="fsdp")
    p.add_argument("--steps", type=int, default=40, help="train until this step")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint-interval", type=int, default=20)
    p.add_argument("--out", default="runs/torch-native")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()

    dist.init_process_group("mpidist")  # rank and size from MPI: no MASTER_ADDR, RANK...
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, dp, dp_rank = parallelize(LM(), args.parallel, world)
    if args.global_batch % dp:
        raise SystemExit(f"--global-batch={args.global_batch} must divide by {dp} "
                         "data-parallel ranks")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    step = 0
    latest = os.path.join(args.out, "latest")
    if args.resume and os.path.exists(latest):
        with open(latest) as f:
            step = int(f.read())
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(args.out, f"step-{step:08d}"))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed at step {step} from {args.out} on {world} rank(s), "
                  f"{args.parallel}", flush=True)

    corpus = TextCorpus(64)
    b = args.global_batch // dp
    t0 = time.perf_counter()
    while step < args.steps:
        g = torch.Generator().manual_seed(step)  # the global batch depends on the step only
        ids = torch.randint(len(corpus), (args.global_batch,), generator=g)[dp_rank * b:][:b]
        x, y = (torch.from_numpy(a).long() for a in corpus.batch(ids.numpy()))
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        clip_grad_norm(list(model.parameters()), 1.0)
        opt.step()
        step += 1
        mean = loss.detach().double().reshape(1)
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            print(f"step {step:5d}  loss {mean.item():.4f}  "
                  f"({(time.perf_counter() - t0) / 10 * 1e3:.0f} ms/step)", flush=True)
            t0 = time.perf_counter()
        if step % args.checkpoint_interval == 0 or step == args.steps:
            model_sd, optim_sd = get_state_dict(model, opt)
            path = os.path.join(args.out, f"step-{step:08d}")
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            if rank == 0:
                with open(latest, "w") as f:
                    f.write(str(step))
                print(f"saved {path}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
