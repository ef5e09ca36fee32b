"""After a rank died and the survivors shrank, they ``Spawn`` one process and ``Merge``
with it; an allreduce over the merged communicator says who took part.

Rank 2 SIGKILLs itself at iteration 5 of a loop of allreduces. The survivors revoke,
shrink, spawn this program again (which notices its parent communicator), merge, and
allreduce ``world rank + 1`` (the newcomer adds 100): event ``merged`` with the size, the
sum and the seconds of the spawn. The newcomer ends with MPI_Finalize (a spawned process
must), after the survivors' barrier; the survivors leave without it (ftprog.leave).
"""

import ftprog  # noqa: I001 - first: output capture and pid

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

parent = MPI.Comm.Get_parent()
if parent != MPI.COMM_NULL:
    union = parent.Merge(high=True)
    parent.Disconnect()
    total = np.array([100.0])
    union.Allreduce(MPI.IN_PLACE, total)
    ftprog.event("merged", size=union.Get_size(), sum=float(total[0]), newcomer=True)
    union.Barrier()
    sys.exit(0)  # MPI_Finalize at exit

world = MPI.COMM_WORLD
rank = world.Get_rank()
comm = world.Dup()
ones = np.ones(1)
for i in range(10_000):
    if i == 5 and rank == 2:
        ftprog.event("killing", point="iteration-5")
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.Allreduce(MPI.IN_PLACE, ones)
        ones[:] = 1
    except MPI.Exception:
        break
comm.Revoke()
shrunk = comm.Shrink()
t0 = time.perf_counter()
inter = shrunk.Spawn(sys.executable, [__file__], maxprocs=1, root=0)
union = inter.Merge(high=False)
inter.Disconnect()
spawn_s = time.perf_counter() - t0
total = np.array([float(rank + 1)])
union.Allreduce(MPI.IN_PLACE, total)
ftprog.event("merged", size=union.Get_size(), sum=float(total[0]), spawn_s=spawn_s,
             newcomer=False)
ftprog.leave(union, 0)
