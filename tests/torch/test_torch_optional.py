"""torch stays an optional extra: the core never imports it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_core_does_not_import_torch():
    code = ("import sys, mpidist, mpidist.parallel, mpidist.parallel.adapters, mpidist.checkpoint, "
            "mpidist.nn, mpidist.cli; sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_cuda_tensors(capsys):
    """The wrappers' CUDA paths (CUDA-aware MPI or staging through host buffers) need a GPU;
    they run where torch sees one."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch: the CUDA paths of mpidist.torch are "
                    "checked on a GPU machine")
    from mpi4py import MPI

    from mpidist.torch import DistributedDataParallel, ZeroRedundancyOptimizer, fully_shard

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                              torch.nn.Linear(16, 4)).double().cuda()
    nets = []
    for kind in ("ddp", "zero", "fsdp"):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                torch.nn.Linear(16, 4)).double().cuda()
        if kind == "ddp":
            net = DistributedDataParallel(m, comm=MPI.COMM_SELF)
            opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        elif kind == "zero":
            net = m
            opt = ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, comm=MPI.COMM_SELF,
                                          lr=1e-2)
        else:
            net = fully_shard(m, comm=MPI.COMM_SELF)
            opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        nets.append((net, opt))
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    x = torch.randn(32, 8, dtype=torch.float64, device="cuda")
    for _ in range(3):
        for net, opt in [*nets, (ref, ropt)]:
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    want = [p.detach().cpu() for p in ref.parameters()]
    for net, _ in nets:
        got = [p.detach().cpu() for p in net.parameters()]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
