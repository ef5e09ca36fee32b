"""Allreduces on a Dup of COMM_WORLD until a rank dies; the survivors revoke, shrink, agree
on the last iteration every survivor completed (an allreduce MIN) and go on on the shrunk
communicator.

Each rank adds ``world rank + 1`` (2 MB of float64), so every sum says who took part.
The victim dies at ``ftprog.point("allreduce-<i>")`` (MPIDIST_FT_TEST_KILL) or is killed
from outside after its event ``looping`` (at iteration 10). Event ``recovered`` has what a
survivor saw; exit status 0 when everything was right, 1 when a sum was wrong (the
survivors leave without MPI_Finalize: ftprog.leave).
"""

import ftprog  # noqa: I001 - first: output capture and pid

import sys
import time

import numpy as np
from mpi4py import MPI

from mpidist.core.ft import fault_tolerance

MAX_ITERATIONS = 100_000
MORE = 5

ft = fault_tolerance()
ftprog.event("ft", available=ft.available, line=ft.line())
if not ft.available:
    sys.exit(3)

world = MPI.COMM_WORLD
wrank = world.Get_rank()
comm = world.Dup()
mine = np.full(1 << 18, float(wrank + 1))
out = np.empty_like(mine)
full = float(sum(range(1, world.Get_size() + 1)))
done, failure = 0, None
for i in range(MAX_ITERATIONS):
    ftprog.point(f"allreduce-{i}")
    if i == 10:
        ftprog.event("looping", i=i)
    try:
        comm.Allreduce(mine, out)
    except MPI.Exception as exc:
        failure = exc
        break
    if not (out == full).all():
        ftprog.event("wrong", i=i, got=float(out[0]), expected=full)
        sys.exit(1)
    done = i + 1
if failure is None:
    ftprog.event("no-failure", done=done)
    sys.exit(4)

detected = time.time()
t0 = time.perf_counter()
comm.Revoke()
t1 = time.perf_counter()
comm.Ack_failed()
seen = comm.Get_failed()
seen_failed = MPI.Group.Translate_ranks(seen, list(range(seen.Get_size())), world.Get_group())
t2 = time.perf_counter()
new = comm.Shrink()
t3 = time.perf_counter()
dead = MPI.Group.Difference(comm.Get_group(), new.Get_group())
dead_ranks = MPI.Group.Translate_ranks(dead, list(range(dead.Get_size())), world.Get_group())
counter = np.array([done], dtype=np.int64)
new.Allreduce(MPI.IN_PLACE, counter, op=MPI.MIN)
t4 = time.perf_counter()
survivors = np.empty(new.Get_size(), dtype=np.int64)
new.Allgather(np.array([wrank], dtype=np.int64), survivors)
expected = float((survivors + 1).sum())
sums = []
for _ in range(MORE):
    new.Allreduce(mine, out)
    sums.append(float(out[0]) if (out == out[0]).all() else float("nan"))
ftprog.event("recovered", error_class=failure.Get_error_class(),
             error=failure.Get_error_string().split(":")[0], done=done,
             agreed=int(counter[0]), seen_failed=list(seen_failed), dead=list(dead_ranks),
             size=new.Get_size(), sums=sums, expected=expected, detected=detected,
             revoke_s=t1 - t0, shrink_s=t3 - t2, agree_s=t4 - t3,
             revoked_after=comm.Is_revoked(), shrunk_revoked=new.Is_revoked())
ftprog.leave(new, 0 if sums == [expected] * MORE else 1)
