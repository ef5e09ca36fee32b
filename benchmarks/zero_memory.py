"""Measured per-rank memory of each strategy against the ZeRO formulas.

    for n in 1 2 4; do mpiexec -n $n python benchmarks/zero_memory.py; done

For fp32 Adam with Ψ parameters over N data-parallel ranks the ZeRO paper's model states
are DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N bytes per rank. "measured"
is what ``wrap()`` really allocated (NumPy reports its allocations to tracemalloc);
"working" is the peak of transient buffers during a step (gathered ZeRO-3 units,
gradients of a unit being reduce-scattered).
"""

from __future__ import annotations

import argparse
import tracemalloc

import numpy as np
from mpi4py import MPI

from mpidist.core.mesh import ProcessMesh
from mpidist.nn import GPT, CrossEntropyLoss, GPTConfig
from mpidist.optim import Adam
from mpidist.parallel import STRATEGIES, ShardingConfiguration


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=128)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=args.n_layer, n_head=4,
                    n_embd=args.n_embd)
    rows = []
    for name in ("ddp", "zero1", "zero2", "zero3"):
        opt = STRATEGIES[name](Adam(), ShardingConfiguration(mesh=ProcessMesh(comm)),
                               loss=CrossEntropyLoss())
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        model = opt.wrap(GPT(cfg))
        measured = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        x = np.zeros((n, 32), dtype=np.int64)
        opt.step(model, (x[:1], x[:1]))
        rep = opt.memory_report()
        psi = model.layout.numel
        formula = {"ddp": 16 * psi, "zero1": 8 * psi + 8 * psi / n,
                   "zero2": 4 * psi + 12 * psi / n, "zero3": 16 * psi / n}[name]
        m = np.array([measured, rep["working_peak"]], dtype=np.float64)
        comm.Allreduce(MPI.IN_PLACE, m, op=MPI.MAX)
        rows.append((name, psi, formula, rep["total"], m[0], m[1]))
    if comm.Get_rank() == 0:
        print(f"# N = {n} ranks, fp32 Adam, GPT with {rows[0][1]:,} parameters (Ψ)")
        print(f"{'strategy':<8}{'formula MB':>12}{'reported MB':>13}{'measured MB':>13}"
              f"{'measured/formula':>18}{'working MB':>12}")
        for name, _, formula, reported, measured, working in rows:
            print(f"{name:<8}{formula / 2**20:>12.3f}{reported / 2**20:>13.3f}"
                  f"{measured / 2**20:>13.3f}{measured / formula:>18.3f}{working / 2**20:>12.3f}")


if __name__ == "__main__":
    main()
