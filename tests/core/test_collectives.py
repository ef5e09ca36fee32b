from __future__ import annotations

import numpy as np
import pytest

from mpidist.core import collectives as C

DTYPES = [np.float32, np.float64]


# -- single process: the fast path makes no MPI call --------------------------------------
def test_size_one_fast_path():
    x = np.arange(10, dtype=np.float64)
    assert C.allreduce(x, "avg") is x
    np.testing.assert_array_equal(C.reduce_scatter(x, "sum"), x)
    np.testing.assert_array_equal(C.allgather(x[:4], numel=3), x[:3])
    assert C.broadcast(x) is x
    assert C.iallreduce(x).wait() is x


def test_bad_input():
    x = np.zeros(4)
    with pytest.raises(ValueError, match="op='prod'"):
        C.allreduce(x, "prod")
    with pytest.raises(ValueError, match="op='max'"):
        C.reduce_scatter(x, "max")
    with pytest.raises(ValueError, match="dtype float16"):
        C.allreduce(np.zeros(4, np.float16))
    with pytest.raises(ValueError, match="C-contiguous"):
        C.allreduce(np.zeros((4, 4))[:, 1])
    with pytest.raises(TypeError, match="list"):
        C.allreduce([1.0, 2.0])
    with pytest.raises(ValueError, match="root=3"):
        C.broadcast(x, root=3)
    with pytest.raises(ValueError, match="numel=9"):
        C.allgather(x, numel=9)


# -- MPI -----------------------------------------------------------------------------------
def rank_data(n_elem, rank, dtype, seed=0):
    return np.random.default_rng(seed + 17 * rank).standard_normal(n_elem).astype(dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("blocking", [True, False])
def test_allreduce(comm, dtype, op, blocking):
    n, r = comm.Get_size(), comm.Get_rank()
    everyone = np.stack([rank_data(37, q, dtype) for q in range(n)])
    expected = {"sum": everyone.sum(0), "avg": everyone.sum(0) / n,
                "max": everyone.max(0), "min": everyone.min(0)}[op]
    x = rank_data(37, r, dtype)
    out = C.allreduce(x, op, comm=comm) if blocking else C.iallreduce(x, op, comm=comm).wait()
    assert out is x
    rtol = 1e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(x, expected, rtol=rtol, atol=rtol)


@pytest.mark.mpi(min_size=2)
def test_allreduce_2d_and_int(comm):
    n = comm.Get_size()
    x = np.ones((3, 5), dtype=np.int64)
    C.allreduce(x, comm=comm)
    assert (x == n).all()
    y = np.full(4, 2 * n, dtype=np.int32)
    C.allreduce(y, "avg", comm=comm)
    assert (y == 2 * n).all()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("length", [1, 10, 12, 37])
@pytest.mark.parametrize("blocking", [True, False])
def test_reduce_scatter_then_allgather_pads_odd_lengths(comm, length, blocking):
    n, r = comm.Get_size(), comm.Get_rank()
    total = sum(rank_data(length, q, np.float64) for q in range(n))
    x = rank_data(length, r, np.float64)
    s = -(-length // n)
    if blocking:
        shard = C.reduce_scatter(x, "avg", comm=comm)
    else:
        shard = C.ireduce_scatter(x, "avg", comm=comm).wait()
    assert shard.shape == (s,)
    padded = np.zeros(s * n)
    padded[:length] = total / n
    np.testing.assert_allclose(shard, padded[r * s : (r + 1) * s], rtol=1e-13, atol=1e-15)
    full = C.allgather(shard, comm=comm, numel=length) if blocking else \
        C.iallgather(shard, comm=comm, numel=length).wait()
    assert full.shape == (length,)
    np.testing.assert_allclose(full, total / n, rtol=1e-13)


@pytest.mark.mpi(min_size=2)
def test_reduce_scatter_into_out_and_inplace_allgather(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    buf = np.zeros(4 * n, dtype=np.float32)
    buf[:] = r + 1
    out = np.empty(4, dtype=np.float32)
    got = C.reduce_scatter(buf, "sum", comm=comm, out=out)
    assert got is out
    assert (out == n * (n + 1) / 2).all()
    flat = np.zeros(4 * n, dtype=np.float32)
    flat[4 * r : 4 * r + 4] = r
    assert C.allgather_inplace(flat, comm=comm) is flat
    np.testing.assert_array_equal(flat, np.repeat(np.arange(n, dtype=np.float32), 4))
    flat[:] = 0
    flat[4 * r : 4 * r + 4] = -r
    C.iallgather_inplace(flat, comm=comm).wait()
    np.testing.assert_array_equal(flat, -np.repeat(np.arange(n, dtype=np.float32), 4))
    with pytest.raises(ValueError, match="divisible by the group size"):
        C.allgather_inplace(np.zeros(4 * n + 1), comm=comm)


@pytest.mark.mpi(min_size=2)
def test_allgather_varied_segments_of_any_length(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    counts = [(k * 3) % 4 for k in range(n)]  # 0, 3, 2, 1, 0, ...: empty segments too
    buf = np.full(sum(counts), -1, dtype=np.int16)
    lo = sum(counts[:r])
    buf[lo:lo + counts[r]] = r
    assert C.allgather_varied(buf, counts, comm=comm) is buf
    np.testing.assert_array_equal(buf, np.repeat(np.arange(n), counts))
    with pytest.raises(ValueError, match="do not split"):
        C.allgather_varied(buf, counts[:-1], comm=comm)


@pytest.mark.mpi(min_size=2)
def test_allgather_any_dtype_uint16(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    half = np.full(3, r, dtype=np.float16).view(np.uint16)
    full = C.allgather(half, comm=comm).view(np.float16)
    np.testing.assert_array_equal(full, np.repeat(np.arange(n), 3).astype(np.float16))


@pytest.mark.mpi(min_size=2)
def test_float16_travels_bit_for_bit_outside_reductions(comm):
    # MPI has no 16-bit float type: the collectives carry it as uint16 themselves.
    n, r = comm.Get_size(), comm.Get_rank()
    mine = np.array([r + 0.5, -65504.0, 2.0**-24], dtype=np.float16)
    want = np.concatenate([np.array([k + 0.5, -65504.0, 2.0**-24], np.float16)
                           for k in range(n)])
    got = C.iallgather(mine, comm=comm, out=np.empty(3 * n, np.float16)).wait()
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    inplace = want.copy()
    inplace[3 * r:3 * r + 3] = mine
    C.allgather_inplace(inplace, comm=comm)
    np.testing.assert_array_equal(inplace.view(np.uint16), want.view(np.uint16))
    b = mine.copy() if r == 0 else np.zeros(3, np.float16)
    C.broadcast(b, root=0, comm=comm)
    np.testing.assert_array_equal(b, np.array([0.5, -65504.0, 2.0**-24], np.float16))
    recv = np.zeros(3, np.float16)
    reqs = [C.isend(mine, (r + 1) % n, comm=comm, tag=7),
            C.irecv(recv, (r - 1) % n, comm=comm, tag=7)]
    C.wait_all(reqs)
    np.testing.assert_array_equal(recv, want[3 * ((r - 1) % n):3 * ((r - 1) % n) + 3])


@pytest.mark.mpi(min_size=2)
def test_broadcast(comm):
    root = comm.Get_size() - 1
    x = np.full(5, float(comm.Get_rank()))
    C.broadcast(x, root=root, comm=comm)
    assert (x == root).all()


@pytest.mark.mpi(min_size=2)
def test_ring_send_recv(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    out = np.full(6, float(r))
    inbox = np.empty(6)
    rq = C.irecv(inbox, (r - 1) % n, comm=comm, tag=5)
    sq = C.isend(out, (r + 1) % n, comm=comm, tag=5)
    C.wait_all([rq, sq])
    assert (inbox == (r - 1) % n).all()
    if r == 0:
        C.send(np.arange(3.0), 1, comm=comm)
    elif r == 1:
        got = C.recv(np.empty(3), 0, comm=comm)
        np.testing.assert_array_equal(got, np.arange(3.0))
    with pytest.raises(ValueError, match=f"dest={n}"):
        C.isend(out, n, comm=comm)


@pytest.mark.mpi(min_size=2)
def test_request_test_drives_completion(comm):
    x = np.ones(1000)
    req = C.iallreduce(x, "avg", comm=comm)
    while not req.test():
        pass
    assert req.done and (x == 1).all()


@pytest.mark.mpi(min_size=2)
def test_debug_mode_names_the_ranks_that_differ(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    previous = C.set_debug(True)
    try:
        C.allreduce(np.ones(4), comm=comm)  # consistent: passes
        length = 5 if r == n - 1 else 4
        with pytest.raises(C.CollectiveMismatchError) as info:
            C.allreduce(np.ones(length), comm=comm)
        msg = str(info.value)
        assert f"ranks {list(range(n - 1))}: allreduce[sum] dtype=float64 shape=(4,)" in msg
        assert f"ranks [{n - 1}]: allreduce[sum] dtype=float64 shape=(5,)" in msg
        with pytest.raises(C.CollectiveMismatchError, match="allgather"):
            if r == 0:
                C.allgather(np.ones(2), comm=comm)
            else:
                C.allreduce(np.ones(2), comm=comm)
    finally:
        C.set_debug(previous)
    comm.Barrier()
