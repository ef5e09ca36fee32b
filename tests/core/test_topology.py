"""Node maps and two-level collectives (mpidist.core.topology), checked on one machine by
declaring a node map (``set_node_map``); tests/cluster runs them across real namespaces."""

from __future__ import annotations

import numpy as np
import pytest

from mpidist.core import collectives as C
from mpidist.core import topology as T


def test_node_ids_number_nodes_by_first_rank():
    assert T.node_ids(["b", "a", "b", "c"]) == (0, 1, 0, 2)
    assert T.node_ids([7, 7, 3]) == (0, 0, 1)


def test_node_map_properties():
    m = T.NodeMap((0, 1, 0, 1), ("x", "y"))
    assert m.n_nodes == 2 and m.counts == [2, 2] and m.uniform and m.two_level
    assert m.ranks_on(1) == [1, 3]
    # blocks ordered by (local index, node)
    assert m.column_order() == [0, 1, 2, 3]
    assert T.NodeMap((0, 0, 1, 1)).column_order() == [0, 2, 1, 3]
    assert not T.NodeMap((0, 0, 1)).uniform
    assert not T.NodeMap((0, 1, 2)).two_level      # one rank per node: flat is the same
    assert not T.NodeMap((0, 0, 0)).two_level      # one node
    assert T.NodeMap((0,)).host(3) == "node3"


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("MPIDIST_COLLECTIVES", "flat")
    assert T.default_algorithm() == "flat"
    monkeypatch.setenv("MPIDIST_COLLECTIVES", "tree")
    with pytest.raises(ValueError, match="MPIDIST_COLLECTIVES='tree'"):
        T.default_algorithm()
    monkeypatch.setenv("MPIDIST_HIERARCHICAL_MIN_BYTES", "-1")
    with pytest.raises(ValueError, match="MPIDIST_HIERARCHICAL_MIN_BYTES=-1"):
        T.hierarchical_min_bytes()
    monkeypatch.setenv("MPIDIST_HIERARCHICAL_CHUNK_BYTES", "lots")
    with pytest.raises(ValueError, match="MPIDIST_HIERARCHICAL_CHUNK_BYTES='lots'"):
        T.chunk_bytes()
    with pytest.raises(ValueError, match="algorithm='ring'"):
        C.allreduce(np.ones(3), algorithm="ring")


def _two_nodes(n: int, contiguous: bool) -> list[int]:
    if contiguous:
        return [r * 2 // n for r in range(n)]
    return [r % 2 for r in range(n)]


@pytest.fixture
def small_pieces(monkeypatch):
    # pieces of 1 KiB: every size below runs through several stages of the pipeline
    monkeypatch.setenv("MPIDIST_HIERARCHICAL_CHUNK_BYTES", "1024")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("contiguous", [True, False])
def test_two_level_collectives_equal_flat(comm, small_pieces, contiguous):
    n, r = comm.Get_size(), comm.Get_rank()
    sub = comm.Split(0 if r < n - n % 2 else 1, r)  # an even group: two nodes of n/2
    if r >= n - n % 2:
        sub.Free()
        return
    n = sub.Get_size()
    topo = T.set_node_map(sub, _two_nodes(n, contiguous))
    assert topo.map.two_level
    for count in (1, 7, 130, 1001):
        for dtype in (np.float64, np.float32, np.int64):
            x = (np.random.default_rng(r * 7919 + count).standard_normal(count) * 50)
            x = x.astype(dtype)
            exact = x.dtype.kind == "i"
            big = sub.allreduce(float(np.abs(x).max()) if count else 0.0)
            atol = 0.0 if exact else 4 * n * np.finfo(dtype).eps * big
            for op in ("sum", "avg", "max", "min"):
                flat = C.allreduce(x.copy(), op, comm=sub, algorithm="flat")
                two = C.allreduce(x.copy(), op, comm=sub, algorithm="hierarchical")
                np.testing.assert_allclose(two, flat, rtol=0, atol=atol)
                if exact or op in ("max", "min"):
                    np.testing.assert_array_equal(two, flat)
            rs_flat = C.reduce_scatter(x, comm=sub, algorithm="flat")
            rs_two = C.reduce_scatter(x, comm=sub, algorithm="hierarchical")
            np.testing.assert_allclose(rs_two, rs_flat, rtol=0, atol=atol)
            out = np.empty_like(rs_flat)
            got = C.ireduce_scatter(x, "avg", comm=sub, out=out, algorithm="hierarchical").wait()
            np.testing.assert_allclose(
                got, C.reduce_scatter(x, "avg", comm=sub, algorithm="flat"), rtol=0, atol=atol)
            ag_flat = C.allgather(x, comm=sub, algorithm="flat")
            np.testing.assert_array_equal(C.allgather(x, comm=sub, algorithm="hierarchical"),
                                          ag_flat)
            np.testing.assert_array_equal(
                C.allgather(x, comm=sub, algorithm="hierarchical", numel=n * count - 1),
                ag_flat[:-1])
            buf = np.zeros(n * count, dtype=dtype)
            buf[r * count:(r + 1) * count] = x
            C.iallgather_inplace(buf, comm=sub, algorithm="hierarchical").wait()
            np.testing.assert_array_equal(buf, ag_flat)
    sub.Free()


@pytest.mark.mpi(min_size=4)
def test_two_level_requests_in_flight_together_complete_in_any_order(comm, small_pieces):
    """DDP buckets and ZeRO units overlap collectives; ranks advance them differently."""
    n, r = comm.Get_size(), comm.Get_rank()
    sub = comm.Split(0 if r < n - n % 2 else 1, r)
    if r >= n - n % 2:
        sub.Free()
        return
    n = sub.Get_size()
    T.set_node_map(sub, _two_nodes(n, True))
    xs = [np.full(300 + 17 * i, float(r + i)) for i in range(4)]
    reqs = [C.iallreduce(x, comm=sub, algorithm="hierarchical") for x in xs]
    # even ranks poll the last request first, odd ranks wait in order
    if r % 2 == 0:
        while not reqs[-1].test():
            pass
        order = reversed(range(4))
    else:
        order = range(4)
    for i in order:
        reqs[i].wait()
    for i, x in enumerate(xs):
        assert (x == sum(q + i for q in range(n))).all()
    sub.Free()


@pytest.mark.mpi(min_size=2)
def test_auto_stays_flat_on_one_node_and_for_small_messages(comm, monkeypatch):
    sub = comm.Dup()
    assert T.choose_algorithm(sub, 1 << 30, "auto") is None or T.topology(sub).map.n_nodes > 1
    T.set_node_map(sub, _two_nodes(sub.Get_size(), True))
    monkeypatch.setenv("MPIDIST_HIERARCHICAL_MIN_BYTES", "4096")
    if sub.Get_size() >= 4 and sub.Get_size() % 2 == 0:
        assert T.choose_algorithm(sub, 4096, "auto") is not None
    assert T.choose_algorithm(sub, 4095, "auto") is None
    assert T.choose_algorithm(sub, 1 << 30, "flat") is None
    sub.Free()


@pytest.mark.mpi(min_size=2)
def test_detected_node_map_on_this_machine(comm):
    topo = T.topology(comm)
    assert topo.map.nodes == (0,) * comm.Get_size()  # the suite runs on one machine
    assert T.topology(comm) is topo                   # cached on the communicator
