"""What the ULFM calls do around a failure, as in-job recovery relies on it (event
``semantics`` per survivor; the test checks it).

Four ranks on a Dup of COMM_WORLD. Rank 0 posts a receive from rank 2, which never sends
(a request pending on a live peer). Rank 3 dies at ``ftprog.point("iallreduce")`` instead
of joining an Iallreduce the others have started. Then: the Iallreduce's Wait raises; the
pending receive is still pending (its peer is alive); rank 1 alone revokes, half a second
later; ranks 0 and 2 poll ``Is_revoked()`` alone for 1.5 s (with Open MPI 5.0 it stays
false: it makes no MPI progress; recorded, not checked), then with MPI progress (an
Iprobe), which shows the revoke at once; the pending receive now ends with
MPI_ERR_REVOKED; ``Agree`` raises MPI_ERR_PROC_FAILED until ``Ack_failed``, then returns
the bitwise AND of the flags on the revoked communicator; COMM_WORLD is not revoked, but
its collectives fail; after ``Shrink`` a parallel HDF5 file (driver mpio) is written and
read on the survivors, which leave without MPI_Finalize (ftprog.leave). Argument: the
HDF5 file's path.
"""

import ftprog  # noqa: I001 - first: output capture and pid

import sys
import time

import h5py
import numpy as np
from mpi4py import MPI

path = sys.argv[1]
world = MPI.COMM_WORLD
wrank = world.Get_rank()
comm = world.Dup()
seen: dict = {"revoked_before": comm.Is_revoked()}


def error_name(exc: MPI.Exception) -> str:
    return exc.Get_error_string().split(":")[0]


pending = comm.Irecv(np.zeros(1), source=2, tag=7) if wrank == 0 else None
comm.Barrier()
ftprog.point("iallreduce")
send, recv = np.ones(1 << 16), np.empty(1 << 16)
req = comm.Iallreduce(send, recv)
t0 = time.perf_counter()
try:
    req.Wait()
    seen["iallreduce"] = "completed"
except MPI.Exception as exc:
    seen["iallreduce"] = error_name(exc)
seen["iallreduce_s"] = time.perf_counter() - t0
if pending is not None:
    try:
        seen["pending_before_revoke"] = "completed" if pending.Test() else "pending"
    except MPI.Exception as exc:  # rank 1 revoked already: too slow a machine
        seen["pending_before_revoke"] = error_name(exc)
if wrank == 1:
    time.sleep(0.5)  # the others have seen the Iallreduce fail by then
    comm.Revoke()
else:  # Is_revoked alone makes no MPI progress; a call that does (Iprobe) lets it show
    t0 = time.perf_counter()
    while not comm.Is_revoked() and time.perf_counter() - t0 < 1.5:
        time.sleep(0.001)
    seen["revoked_seen_without_progress"] = comm.Is_revoked()
    t0 = time.perf_counter()
    while not comm.Is_revoked() and time.perf_counter() - t0 < 20:
        try:
            comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
        except MPI.Exception as exc:
            seen["iprobe"] = error_name(exc)
        time.sleep(0.001)
    seen["saw_revoked_s"] = time.perf_counter() - t0
seen["revoked_after"] = comm.Is_revoked()
if pending is not None:
    try:
        pending.Wait()
        seen["pending"] = "completed"
    except MPI.Exception as exc:
        seen["pending"] = error_name(exc)
try:
    seen["agree_before_ack"] = comm.Agree(0b111)
except MPI.Exception as exc:
    seen["agree_before_ack"] = error_name(exc)
comm.Ack_failed()
failed = comm.Get_failed()
seen["failed"] = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())),
                                           world.Get_group())
seen["agree_after_ack"] = comm.Agree(0b101 if wrank == 1 else 0b111)
try:
    comm.Barrier()
    seen["barrier_on_revoked"] = "completed"
except MPI.Exception as exc:
    seen["barrier_on_revoked"] = error_name(exc)
seen["world_revoked"] = world.Is_revoked()
try:
    world.Allreduce(MPI.IN_PLACE, np.ones(1))
    seen["world_allreduce"] = "completed"
except MPI.Exception as exc:
    seen["world_allreduce"] = error_name(exc)
new = comm.Shrink()
with h5py.File(path, "w", driver="mpio", comm=new) as f:
    d = f.create_dataset("x", (new.Get_size(), 1000), dtype="f8")
    d[new.Get_rank()] = np.full(1000, float(wrank))
new.Barrier()
with h5py.File(path, "r", driver="mpio", comm=new) as f:
    seen["h5_rows"] = [float(v) for v in f["x"][:, 0]]
ftprog.event("semantics", **seen)
ftprog.leave(new)
