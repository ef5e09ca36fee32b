"""A failure is seen only on the communicator it happened in; ranks blocked on another one
learn of it only when that one is revoked too.

Four ranks: ``comm`` is a Dup of COMM_WORLD, ``sub`` a Split of ranks {0, 1, 2}. Rank 3
dies (at ``ftprog.point("die")``, MPIDIST_FT_TEST_KILL) while rank 2 waits on a receive
from it on ``comm``; ranks 0 and 1 are in an Allreduce on ``sub``, waiting for rank 2,
which never comes: the dead rank is not in ``sub``. Rank 2 sees the failure, revokes
``comm``, waits HOLD seconds (argument), then revokes ``sub``. Ranks 0 and 1 stay blocked
through the first revoke, although ``comm`` is revoked for them too, and leave the
Allreduce with MPI_ERR_REVOKED only after the second. Then every survivor shrinks both.
"""

import ftprog  # noqa: I001 - first: output capture and pid

import sys
import time

import numpy as np
from mpi4py import MPI

HOLD = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0

world = MPI.COMM_WORLD
wrank = world.Get_rank()
comm = world.Dup()
sub = world.Split(0 if wrank < 3 else MPI.UNDEFINED, wrank)
comm.Barrier()
if wrank == 3:
    time.sleep(0.3)  # the others are waiting by then
    ftprog.point("die")
    ftprog.event("survived-the-kill-point")
    sys.exit(5)
if wrank in (0, 1):
    x = np.ones(1)
    try:
        sub.Allreduce(MPI.IN_PLACE, x)
        ftprog.event("sub-completed")  # must not happen: rank 2 never joins
        sys.exit(1)
    except MPI.Exception as exc:
        ftprog.event("unblocked", error_class=exc.Get_error_class(),
                     comm_revoked=comm.Is_revoked(), sub_revoked=sub.Is_revoked())
else:
    b = np.zeros(1)
    try:
        comm.Recv(b, source=3)
        ftprog.event("received")  # must not happen: rank 3 sends nothing
        sys.exit(1)
    except MPI.Exception as exc:
        ftprog.event("detected", error_class=exc.Get_error_class())
    comm.Revoke()
    ftprog.event("revoked-comm")
    time.sleep(HOLD)
    ftprog.event("revoking-sub")
    sub.Revoke()
new_comm = comm.Shrink()
new_sub = sub.Shrink()
x, y = np.array([wrank + 1.0]), np.array([wrank + 1.0])
new_comm.Allreduce(MPI.IN_PLACE, x)
new_sub.Allreduce(MPI.IN_PLACE, y)
ftprog.event("shrunk", comm_size=new_comm.Get_size(), sub_size=new_sub.Get_size(),
             comm_sum=float(x[0]), sub_sum=float(y[0]))
ftprog.leave(new_comm)
