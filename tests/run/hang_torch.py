"""A small torch training script on the "mpidist" backend, for the hang tests
(tests/run/test_hang.py): torch's DistributedDataParallel over a tiny model, many steps,
each marked for the flight recorder with ``comms.set_step`` and ``comms.phase``; rank 0
prints ``step N`` after each step. Run as ``mpiexec -n N python hang_torch.py STEPS``."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import mpidist.torch  # noqa: F401 - registers the backend
from mpidist.core import comms


def main(steps: int) -> None:
    dist.init_process_group("mpidist")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, steps + 1):
        comms.set_step(step)
        x = torch.randn(4, 8)
        with comms.phase("forward"):
            loss = model(x).square().mean()
        with comms.phase("backward"):
            loss.backward()  # DDP's gradient all_reduce
        with comms.phase("optimizer"):
            opt.step()
            opt.zero_grad()
            dist.all_reduce(loss.detach())
        if dist.get_rank() == 0:
            print(f"step {step}", flush=True)
        time.sleep(0.005)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
