"""ProcessMesh: one MPI Cartesian communicator with named dims (pp, dp, tp).

Dims are ordered (pp, dp, tp) in row-major order, so tp varies fastest: ranks of one
tensor-parallel group are consecutive mesh ranks. The rank → coordinates map is also a pure
function, `layout`, which tests check without MPI.

Placement: the mesh learns each rank's node (shared-memory domains, see
:mod:`mpidist.core.topology`) and numbers its ranks node by node (`node_order`), so tensor-parallel
groups lie inside one node and data-parallel peers come next, whatever order the launcher
gave the ranks (``mpirun --map-by node`` deals them round-robin). When the launcher already
placed ranks in blocks, mesh ranks equal the ranks of the given communicator.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpidist.core import recorder
from mpidist.core.comms import label, world
from mpidist.core.topology import NodeMap, node_ids, topology

__all__ = [
    "DIMS",
    "MeshShape",
    "ProcessMesh",
    "describe_nodes",
    "layout",
    "node_order",
    "resolve_shape",
    "split_tp_groups",
]

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


def node_order(nodes: Sequence[Any]) -> list[int]:
    """Ranks node by node: ``node_order(nodes)[mesh_rank] == rank``. Pure.

    ``nodes[r]`` is any key of rank r's node (an index, a host name). Nodes come in the order
    of their lowest rank, ranks ascending inside a node, so a block placement maps to itself
    and a round-robin one is regrouped: ``node_order([0, 1, 0, 1]) == [0, 2, 1, 3]``.
    """
    ids = node_ids(list(nodes))
    return sorted(range(len(ids)), key=lambda r: (ids[r], r))


def split_tp_groups(nodes: Sequence[Any], tp: int, order: Sequence[int] | None = None) -> list[int]:
    """Indices of the tensor-parallel groups that span more than one node. Pure.

    Group g holds mesh ranks ``[g*tp, (g+1)*tp)``; ``order[mesh_rank]`` is the rank whose
    node ``nodes`` gives (default: :func:`node_order`).
    """
    order = node_order(nodes) if order is None else list(order)
    ids = node_ids(list(nodes))
    return [g for g in range(len(order) // tp)
            if len({ids[order[m]] for m in range(g * tp, (g + 1) * tp)}) > 1]


def describe_nodes(nodes: NodeMap, shape: MeshShape, width: int = 8) -> list[str]:
    """One line per node: its host and the mesh ranks on it with their coordinates. Pure.

    ``nodes.nodes[mesh_rank]`` is the node of each mesh rank.
    """
    coords = layout(shape.size, shape.pp, shape.tp, shape.dp)
    lines = []
    for k in range(nodes.n_nodes):
        ranks = nodes.ranks_on(k)
        items = [f"{m}(pp{coords[m]['pp']},dp{coords[m]['dp']},tp{coords[m]['tp']})"
                 for m in ranks[:width]]
        more = f" ... {len(ranks) - width} more" if len(ranks) > width else ""
        lines.append(f"{nodes.host(k)}: {len(ranks)} rank(s) {' '.join(items)}{more}")
    return lines


_TP_WARNED = False


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
    (reorder off, over ``comm``'s ranks in node order, see ``placement``: with a block
    placement mesh ranks equal ranks in ``comm``) and the ``Cart_sub`` groups it hands out,
    and frees exactly those in :meth:`free`. The node map it learns is cached on ``comm``.

    Args:
        comm: the communicator to build on (an ``mpi4py.MPI.Intracomm``); None means
            ``MPI.COMM_WORLD``. Entry points pass it; library code below never reads it.
        pp, tp: pipeline and tensor parallel sizes.
        dp: data parallel size; -1 infers it from the world size.
        placement: "node" (default) numbers mesh ranks node by node (:func:`node_order`);
            "launcher" keeps the ranks of ``comm``.
        nodes: the node of each rank of ``comm`` (any keys), instead of detecting it.

    With node placement, mesh rank r is rank ``order[r]`` of ``comm`` (``mesh.order``); when
    a tensor-parallel group cannot fit in one node, mesh rank 0 warns once per process.
    Every rank of a mesh keeps a flight recorder (:mod:`mpidist.core.recorder`).
    """

    def __init__(
        self, comm: Any = None, *, pp: int = 1, tp: int = 1, dp: int = -1,
        placement: str = "node", nodes: Sequence[Any] | None = None,
    ) -> None:
        comm = world(comm)
        self.shape = resolve_shape(comm.Get_size(), pp, tp, dp)
        if placement not in ("node", "launcher"):
            raise ValueError(f"placement={placement!r} is not 'node' or 'launcher'")
        if nodes is not None and len(nodes) != comm.Get_size():
            raise ValueError(f"nodes has {len(nodes)} entries for {comm.Get_size()} ranks")
        self._groups: dict[tuple[str, ...], Any] = {}
        recorder.install()  # every rank of a mesh keeps a flight recorder
        recorder.introduce(comm)
        found = nodes if nodes is not None else (
            topology(comm).map.nodes if comm.Get_size() > 1 else (0,))
        hosts = topology(comm).map.hosts if nodes is None and comm.Get_size() > 1 else ()
        order = node_order(found) if placement == "node" else list(range(comm.Get_size()))
        self.order: list[int] = order
        ids = node_ids(list(found))
        self.nodes = NodeMap(node_ids([ids[r] for r in order]), hosts)
        base = comm
        if order != sorted(order):
            base = comm.Split(0, order.index(comm.Get_rank()))
        self.comm: Any = label(base.Create_cart(
            list(self.shape.as_tuple()), periods=[False] * 3, reorder=False
        ), "mesh")
        if base is not comm:
            base.Free()
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.shape.size
        c = layout(self.size, self.shape.pp, self.shape.tp, self.shape.dp)[self.rank]
        self.coords: dict[str, int] = c
        got = tuple(self.comm.Get_coords(self.rank))
        if got != (c["pp"], c["dp"], c["tp"]):  # pragma: no cover - an MPI library bug
            raise RuntimeError(f"rank {self.rank}: MPI coords {got} differ from layout {c}")
        self._warn_split_tp(found)

    def _warn_split_tp(self, found: Sequence[Any]) -> None:
        global _TP_WARNED
        split = split_tp_groups(found, self.shape.tp, self.order) if self.shape.tp > 1 else []
        if split and self.rank == 0 and not _TP_WARNED:
            _TP_WARNED = True
            warnings.warn(
                f"{len(split)} of {self.size // self.shape.tp} tensor-parallel groups "
                f"(tp={self.shape.tp}) span two or more nodes (ranks per node: "
                f"{self.nodes.counts}); their activations cross the inter-node link",
                RuntimeWarning, stacklevel=3,
            )

    def describe_nodes(self) -> list[str]:
        """The layout by node, one line per node (see :func:`describe_nodes`). Not collective."""
        return describe_nodes(self.nodes, self.shape)

    def node_banner(self) -> str:
        """The layout by node as indented lines ending in a newline; "" on one node."""
        if self.nodes.n_nodes <= 1:
            return ""
        return "".join(f"  {line}\n" for line in self.describe_nodes())

    # -- groups ---------------------------------------------------------------------
    def group(self, dims: str | Iterable[str]) -> Any:
        """The communicator of this rank's group along ``dims`` (e.g. "dp" or ("dp", "tp")).

        Collective over the mesh the first time a given dims combination is asked for
        (``Cart_sub``); cached afterwards. Ranks in the group are ordered by their
        coordinates along those dims.
        """
        key = _dims_key(dims)
        if key not in self._groups:
            self._groups[key] = label(self.comm.Sub([d in key for d in DIMS]), "+".join(key))
        return self._groups[key]

    def group_size(self, dims: str | Iterable[str]) -> int:
        """Size of the group along ``dims``; pure arithmetic, no communication."""
        return math.prod(self.shape[d] for d in _dims_key(dims))

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

