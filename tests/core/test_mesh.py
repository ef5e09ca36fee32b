from __future__ import annotations

import itertools

import pytest

from mpidist.core.mesh import ProcessMesh, layout, resolve_shape


def factorizations(n: int):
    for pp, tp in itertools.product(range(1, n + 1), repeat=2):
        if n % (pp * tp) == 0:
            yield pp, n // (pp * tp), tp


def test_layout_tp_fastest():
    coords = layout(8, pp=2, tp=2)
    assert coords[0] == {"pp": 0, "dp": 0, "tp": 0}
    assert coords[1] == {"pp": 0, "dp": 0, "tp": 1}
    assert coords[2] == {"pp": 0, "dp": 1, "tp": 0}
    assert coords[4] == {"pp": 1, "dp": 0, "tp": 0}
    assert coords[7] == {"pp": 1, "dp": 1, "tp": 1}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8, 12])
def test_layout_is_a_bijection(n):
    for pp, dp, tp in factorizations(n):
        coords = layout(n, pp=pp, tp=tp, dp=dp)
        assert len({(c["pp"], c["dp"], c["tp"]) for c in coords}) == n
        for rank, c in enumerate(coords):
            assert rank == (c["pp"] * dp + c["dp"]) * tp + c["tp"]


def test_dp_inferred():
    assert resolve_shape(12, pp=2, tp=3).as_tuple() == (2, 2, 3)
    assert resolve_shape(1).as_tuple() == (1, 1, 1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=4, pp=3), "pp=3 x tp=1 = 3 does not divide the world size 4"),
        (dict(world_size=4, pp=2, tp=2, dp=2), "does not equal the world size 4"),
        (dict(world_size=4, pp=0), "pp=0 must be >= 1"),
        (dict(world_size=4, tp=-2), "tp=-2 must be >= 1"),
        (dict(world_size=4, dp=0), "dp=0 must be >= 1"),
        (dict(world_size=4, pp=1.5), "pp=1.5 must be an integer"),
        (dict(world_size=4, tp="2"), "tp='2' must be an integer"),
        (dict(world_size=4, dp=True), "dp=True must be an integer"),
        (dict(world_size=0), "world_size=0 must be >= 1"),
    ],
)
def test_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_shape(**kwargs)


def test_single_process_mesh():
    from mpi4py import MPI

    with ProcessMesh(MPI.COMM_SELF) as mesh:
        assert mesh.shape.as_tuple() == (1, 1, 1)
        assert mesh.coords == {"pp": 0, "dp": 0, "tp": 0}
        assert mesh.group("dp").Get_size() == 1
        assert mesh.neighbours("pp") == (None, None)


def test_bad_group_name():
    from mpi4py import MPI

    with ProcessMesh(MPI.COMM_SELF) as mesh, pytest.raises(ValueError, match="'xx'"):
        mesh.group("xx")


@pytest.mark.mpi(min_size=2)
def test_mesh_matches_layout_for_every_factorization(comm):
    n = comm.Get_size()
    for pp, dp, tp in factorizations(n):
        with ProcessMesh(comm, pp=pp, tp=tp, dp=dp) as mesh:
            expected = layout(n, pp=pp, tp=tp, dp=dp)
            assert mesh.coords == expected[comm.Get_rank()]
            assert mesh.rank == comm.Get_rank()
            for dims in ("pp", "dp", "tp", ("dp", "tp"), ("pp", "dp"), ("pp", "dp", "tp")):
                g = mesh.group(dims)
                assert g.Get_size() == mesh.group_size(dims)
                assert g.Get_rank() == mesh.group_rank(dims)
                # Members of my group: those whose coordinates agree outside `dims`.
                dims_t = (dims,) if isinstance(dims, str) else dims
                members = [
                    r for r, c in enumerate(expected)
                    if all(c[d] == mesh.coords[d] for d in ("pp", "dp", "tp") if d not in dims_t)
                ]
                assert g.Get_size() == len(members)
            src, dst = mesh.neighbours("pp")
            i = mesh.coords["pp"]
            assert src == (mesh.rank_of(i - 1, mesh.coords["dp"], mesh.coords["tp"]) if i else None)
            assert dst == (
                mesh.rank_of(i + 1, mesh.coords["dp"], mesh.coords["tp"]) if i + 1 < pp else None
            )


@pytest.mark.mpi(min_size=2)
def test_mesh_bad_input_raises_on_every_rank_before_communicating(comm):
    n = comm.Get_size()
    with pytest.raises(ValueError, match=f"pp={n + 1}"):
        ProcessMesh(comm, pp=n + 1)
    # Every rank raised without a collective: the communicator is still in step.
    comm.Barrier()


# -- node-aware placement ------------------------------------------------------------------
def test_node_order_keeps_a_block_placement_and_regroups_round_robin():
    from mpidist.core.mesh import node_order

    assert node_order(["a", "a", "b", "b"]) == [0, 1, 2, 3]
    assert node_order(["a", "b", "a", "b"]) == [0, 2, 1, 3]
    assert node_order([1, 0, 1, 0, 1, 0]) == [0, 2, 4, 1, 3, 5]
    # nodes come in the order of their lowest rank, whatever their names
    assert node_order(["z", "y", "y", "z", "x"]) == [0, 3, 1, 2, 4]


@pytest.mark.parametrize(("nodes", "tp", "split"), [
    (["a", "b", "a", "b"], 2, []),             # round-robin: regrouped, no tp group split
    (["a"] * 3 + ["b"] * 3, 2, [1]),           # 3 ranks a node: the middle group straddles
    (["a"] * 3 + ["b"] * 3, 3, []),
    (["a", "b", "c", "d"], 2, [0, 1]),         # one rank per node: every group straddles
    (["a"] * 8, 4, []),
])
def test_split_tp_groups(nodes, tp, split):
    from mpidist.core.mesh import split_tp_groups

    assert split_tp_groups(nodes, tp) == split


def test_split_tp_groups_with_the_launchers_order():
    from mpidist.core.mesh import split_tp_groups

    assert split_tp_groups(["a", "b", "a", "b"], 2, order=[0, 1, 2, 3]) == [0, 1]


def test_describe_nodes():
    from mpidist.core.mesh import MeshShape, describe_nodes
    from mpidist.core.topology import NodeMap

    lines = describe_nodes(NodeMap((0, 0, 1, 1), ("n1", "n2")), MeshShape(1, 2, 2))
    assert lines == ["n1: 2 rank(s) 0(pp0,dp0,tp0) 1(pp0,dp0,tp1)",
                     "n2: 2 rank(s) 2(pp0,dp1,tp0) 3(pp0,dp1,tp1)"]
    long = describe_nodes(NodeMap((0,) * 12), MeshShape(1, 12, 1), width=2)
    assert long[0].startswith("node0: 12 rank(s) 0(") and long[0].endswith("... 10 more")


def test_mesh_placement_bad_input():
    from mpi4py import MPI

    with pytest.raises(ValueError, match="placement='x'"):
        ProcessMesh(MPI.COMM_SELF, placement="x")
    with pytest.raises(ValueError, match="nodes has 2 entries for 1 ranks"):
        ProcessMesh(MPI.COMM_SELF, nodes=["a", "b"])


@pytest.mark.mpi(min_size=2)
def test_mesh_regroups_ranks_dealt_round_robin(comm):
    n = comm.Get_size()
    nodes = [r % 2 for r in range(n)]  # as `mpirun --map-by node` on two nodes
    tp = 2 if n % 2 == 0 and n >= 4 else 1
    with ProcessMesh(comm, tp=tp, nodes=nodes) as mesh:
        order = sorted(range(n), key=lambda r: (r % 2, r))
        assert mesh.order == order
        assert mesh.rank == order.index(comm.Get_rank())
        assert mesh.nodes.nodes == tuple(nodes[r] for r in order)
        # the tp group's members all sit on one node
        members = mesh.group("tp").allgather(nodes[comm.Get_rank()])
        assert len(set(members)) == 1
    with ProcessMesh(comm, tp=tp, nodes=nodes, placement="launcher") as mesh:
        assert mesh.rank == comm.Get_rank() and mesh.order == list(range(n))


@pytest.mark.mpi(min_size=4)
def test_mesh_warns_once_when_a_tp_group_cannot_fit(comm):
    import warnings

    import mpidist.core.mesh as M

    n = comm.Get_size()
    nodes = list(range(n))  # one rank per node: no tp group fits
    M._TP_WARNED = False
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            ProcessMesh(comm, tp=2 if n % 2 == 0 else n, nodes=nodes).free()
    mine = [w for w in seen if "tensor-parallel groups" in str(w.message)]
    assert len(mine) == (1 if comm.Get_rank() == 0 else 0)
