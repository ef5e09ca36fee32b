from __future__ import annotations

import itertools

import pytest

from mpidist.mesh import ProcessMesh, layout, resolve_shape


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
