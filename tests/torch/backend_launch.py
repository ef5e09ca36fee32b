"""Scripts the launch tests run under mpiexec or plain python (one per ``sys.argv[1]``);
each prints one JSON line per rank."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import mpidist.torch  # noqa: F401 - registers the backend
from mpidist.core import topology


def report(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def plain() -> None:
    """init_process_group("mpidist") with no variables; torchrun's variables afterwards."""
    dist.init_process_group("mpidist")
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    # 1 MiB: at least MPIDIST_HIERARCHICAL_MIN_BYTES, so two levels where the world spans nodes
    stages = topology.allreduce_stages
    ran = []
    topology.allreduce_stages = lambda *a: (ran.append(1), stages(*a))[1]
    big = torch.ones(1 << 18) * (dist.get_rank() + 1)
    dist.all_reduce(big)
    topology.allreduce_stages = stages
    report(rank=dist.get_rank(), size=dist.get_world_size(), backend=dist.get_backend(),
           sum=t.item(), env={k: os.environ.get(k) for k in
                              ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")},
           store=type(store).__name__, big=big[-1].item(), two_level=bool(ran))
    dist.destroy_process_group()


def fails() -> None:
    """Rank 1 raises after init; the others wait in a collective."""
    dist.init_process_group("mpidist")
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()
    dist.all_reduce(torch.ones(1))


def stalls() -> None:
    """A group with a 2 s timeout; rank 1 never joins the all_reduce."""
    dist.init_process_group("mpidist", timeout=timedelta(seconds=2))
    if dist.get_rank() == 1:
        time.sleep(60)
    dist.all_reduce(torch.ones(1))


def mixed() -> None:
    """A mixed backend string: mpidist serves the CPU, gloo the other device."""
    dist.init_process_group(sys.argv[2])
    group = dist.group.WORLD
    t = torch.ones(2) * dist.get_rank()
    dist.all_reduce(t)
    other = group.backend_for("cuda")
    u = torch.ones(2)
    other.allreduce([u]).wait()  # gloo's group, CPU tensors: the wiring of the other backend
    report(rank=dist.get_rank(), config=dist.get_backend_config(), cpu=t.tolist(),
           other=type(other).__name__, other_sum=u.tolist(),
           devices=[d.type for d in group._device_types])
    dist.destroy_process_group()


def in_gloo_world() -> None:
    """A world started on gloo (variables supplied from MPI) with an mpidist subgroup."""
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    group = dist.new_group(list(range(n)), backend="mpidist")
    t = torch.ones(3, dtype=torch.bfloat16) * (dist.get_rank() + 1)
    dist.all_reduce(t, group=group)
    u = torch.ones(1) * dist.get_rank()
    dist.all_reduce(u)  # gloo's
    report(rank=dist.get_rank(), world=dist.get_backend(), sub=dist.get_backend(group),
           sum=t.tolist(), gloo_sum=u.item())
    dist.destroy_process_group()


def thin_layer() -> None:
    """The old import: mpidist.torch.distributed."""
    import mpidist.torch.distributed as mdist

    mdist.init_process_group()
    t = torch.ones(1)
    mdist.all_reduce(t)
    report(rank=mdist.get_rank(), sum=t.item(), backend=dist.get_backend())
    mdist.destroy_process_group()


if __name__ == "__main__":
    {"plain": plain, "fails": fails, "stalls": stalls, "mixed": mixed,
     "in_gloo_world": in_gloo_world, "thin_layer": thin_layer}[sys.argv[1]]()
