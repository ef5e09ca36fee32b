"""ProcessMesh: one MPI Cartesian communicator with named dims (pp, dp, tp).

Dims are ordered (pp, dp, tp) in row-major order, so tp varies fastest: ranks of one
tensor-parallel group are consecutive and, with the usual block placement of ranks on
nodes, sit on one node. The rank → coordinates map is also a pure function, `layout`,
which tests check without MPI.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DIMS", "MeshShape", "ProcessMesh", "layout", "resolve_shape"]

DIMS: tuple[str, str, str] = ("pp", "dp", "tp")


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the three mesh dims."""

    pp: int
    dp: int
    tp: int

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.tp

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    def __getitem__(self, dim: str) -> int:
        if dim not in DIMS:
            raise KeyError(f"unknown mesh dim {dim!r}; dims are {DIMS}")
        return int(getattr(self, dim))


def resolve_shape(world_size: int, pp: int = 1, tp: int = 1, dp: int = -1) -> MeshShape:
    """Check the sizes and infer ``dp=-1`` from the world size. Pure; raises ValueError.

    Every rank computes the same answer from the same arguments, so a bad mesh raises the
    same error on every rank before any communicator exists.
    """
    values = {"world_size": world_size, "pp": pp, "tp": tp, "dp": dp}
    for name, v in values.items():
        if not _is_int(v):
            raise ValueError(f"{name}={v!r} must be an integer")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    for name in ("pp", "tp"):
        if values[name] < 1:
            raise ValueError(f"{name}={values[name]} must be >= 1")
    if dp == -1:
        if world_size % (pp * tp):
            raise ValueError(
                f"pp={pp} x tp={tp} = {pp * tp} does not divide the world size {world_size}"
            )
        dp = world_size // (pp * tp)
    elif dp < 1:
        raise ValueError(f"dp={dp} must be >= 1, or -1 to infer it from the world size")
    if pp * dp * tp != world_size:
        raise ValueError(
            f"pp={pp} x dp={dp} x tp={tp} = {pp * dp * tp} does not equal the world size "
            f"{world_size}"
        )
    return MeshShape(int(pp), int(dp), int(tp))


def layout(world_size: int, pp: int = 1, tp: int = 1, dp: int = -1) -> list[dict[str, int]]:
    """Coordinates of every rank: ``layout(...)[rank] == {"pp": i, "dp": j, "tp": k}``.

    The same row-major map that ``MPI.Comm.Create_cart`` with reorder off gives for dims
    (pp, dp, tp): ``rank = (i * dp + j) * tp + k``.
    """
    shape = resolve_shape(world_size, pp, tp, dp)
    out = []
    for rank in range(world_size):
        i, rest = divmod(rank, shape.dp * shape.tp)
        j, k = divmod(rest, shape.tp)
        out.append({"pp": i, "dp": j, "tp": k})
    return out


def _dims_key(dims: str | Iterable[str]) -> tuple[str, ...]:
    names = (dims,) if isinstance(dims, str) else tuple(dims)
    if not names:
        raise ValueError("mesh.group() needs at least one dim name")
    for d in names:
        if d not in DIMS:
            raise ValueError(f"unknown mesh dim {d!r}; dims are {DIMS}")
    if len(set(names)) != len(names):
        raise ValueError(f"dims {names} repeat a name")
    # Cart_sub keeps the Cartesian order whatever order the caller names them in.
    return tuple(d for d in DIMS if d in names)


class ProcessMesh:
    """A 3-D process mesh over ``comm`` with dims (pp, dp, tp).

    Collective over ``comm`` (every rank must construct it with the same sizes; bad sizes
    raise the same ValueError on every rank before any communicator is created). The mesh
    never uses ``comm`` itself after construction: it creates one Cartesian communicator
    (reorder off, so mesh ranks equal ranks in ``comm``) and the ``Cart_sub`` groups it
    hands out, and frees exactly those in :meth:`free`.

    Args:
        comm: the communicator to build on (an ``mpi4py.MPI.Intracomm``); None means
            ``MPI.COMM_WORLD``. Entry points pass it; library code below never reads it.
        pp, tp: pipeline and tensor parallel sizes.
        dp: data parallel size; -1 infers it from the world size.
    """

    def __init__(self, comm: Any = None, *, pp: int = 1, tp: int = 1, dp: int = -1) -> None:
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self.shape = resolve_shape(comm.Get_size(), pp, tp, dp)
        self._groups: dict[tuple[str, ...], Any] = {}
        self.comm: Any = comm.Create_cart(
            list(self.shape.as_tuple()), periods=[False] * 3, reorder=False
        )
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.shape.size
        c = layout(self.size, self.shape.pp, self.shape.tp, self.shape.dp)[self.rank]
        self.coords: dict[str, int] = c
        got = tuple(self.comm.Get_coords(self.rank))
        if got != (c["pp"], c["dp"], c["tp"]):  # pragma: no cover - an MPI library bug
            raise RuntimeError(f"rank {self.rank}: MPI coords {got} differ from layout {c}")

    # -- groups ---------------------------------------------------------------------
    def group(self, dims: str | Iterable[str]) -> Any:
        """The communicator of this rank's group along ``dims`` (e.g. "dp" or ("dp", "tp")).

        Collective over the mesh the first time a given dims combination is asked for
        (``Cart_sub``); cached afterwards. Ranks in the group are ordered by their
        coordinates along those dims.
        """
        key = _dims_key(dims)
        if key not in self._groups:
            self._groups[key] = self.comm.Sub([d in key for d in DIMS])
        return self._groups[key]

    def group_size(self, dims: str | Iterable[str]) -> int:
        """Size of the group along ``dims``; pure arithmetic, no communication."""
        n = 1
        for d in _dims_key(dims):
            n *= self.shape[d]
        return n

    def group_rank(self, dims: str | Iterable[str]) -> int:
        """This rank's index in its group along ``dims``; pure arithmetic."""
        r = 0
        for d in _dims_key(dims):
            r = r * self.shape[d] + self.coords[d]
        return r

    def neighbours(self, dim: str = "pp", disp: int = 1) -> tuple[int | None, int | None]:
        """(source, dest) mesh ranks ``disp`` steps along ``dim`` (``Cart.Shift``).

        None where the mesh ends (the dims are not periodic). Not collective.
        """
        if dim not in DIMS:
            raise ValueError(f"unknown mesh dim {dim!r}; dims are {DIMS}")
        from mpi4py import MPI

        src, dst = self.comm.Shift(DIMS.index(dim), disp)
        return (None if src == MPI.PROC_NULL else src, None if dst == MPI.PROC_NULL else dst)

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        """Mesh rank at the given coordinates; pure arithmetic."""
        s = self.shape
        for name, v, n in (("pp", pp, s.pp), ("dp", dp, s.dp), ("tp", tp, s.tp)):
            if not 0 <= v < n:
                raise ValueError(f"{name}={v} is outside the mesh dim of size {n}")
        return (pp * s.dp + dp) * s.tp + tp

    # -- lifetime -------------------------------------------------------------------
    def free(self) -> None:
        """Free the communicators this mesh created. Collective over the mesh."""
        for g in self._groups.values():
            g.Free()
        self._groups.clear()
        if self.comm is not None:
            self.comm.Free()
            self.comm = None

    def __enter__(self) -> ProcessMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        s = self.shape
        return f"ProcessMesh(pp={s.pp}, dp={s.dp}, tp={s.tp}, rank={self.rank})"

