"""Where the ranks of a communicator run, and two-level collectives across nodes.

A *node map* says on which node each rank of a group runs (ranks that share memory, found
with ``MPI.Comm.Split_type(COMM_TYPE_SHARED)``). Nodes are numbered 0, 1, ... in the order of
their lowest rank. The map is computed once per communicator (collectively, the first time
a collective on it needs it) and cached on the communicator as an MPI attribute, together
with the two sub-communicators a two-level collective uses: ``node`` (the group's ranks on
this node, in group order) and ``cross`` (the ranks with the same local index on every
node, in node order). Freeing the communicator frees them.

Two-level (hierarchical) collectives, on a group spread over N nodes with L ranks each:

* allreduce: reduce-scatter inside the node (shared memory), so local rank i holds the
  node's sum of slice i; allreduce of slice i across the nodes (all L local ranks use the
  link at the same time, each with 1/L of the data); allgather inside the node.
* reduce_scatter: the input's blocks are reordered so that a reduce-scatter inside the
  node leaves local rank i with the node's sums of the blocks of the ranks with local
  index i on every node; a reduce-scatter across the nodes finishes it.
* allgather: the reverse (allgather across the nodes, then inside the node, then the
  blocks back in group order).

Each node sends and receives the inter-node minimum, spread over all its ranks. When they
apply, the settings and how results compare with the flat collectives: the user guide.

The stage functions below are generators that start MPI requests and yield them; the caller
(:class:`mpidist.core.collectives.Request`) waits for each list before resuming the generator.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ALGORITHMS",
    "NodeMap",
    "Topology",
    "choose_algorithm",
    "chunk_bytes",
    "default_algorithm",
    "hierarchical_min_bytes",
    "node_ids",
    "set_node_map",
    "topology",
]

ALGORITHMS = ("auto", "flat", "hierarchical")
_NAME_BYTES = 64
_DEFAULT_MIN_BYTES = 256 * 1024
_DEFAULT_CHUNK_BYTES = 512 * 1024


@dataclass(frozen=True)
class NodeMap:
    """The node of every rank of a group: ``nodes[r]`` and ``hosts[node]``. Pure data."""

    nodes: tuple[int, ...]
    hosts: tuple[str, ...] = ()

    @property
    def n_nodes(self) -> int:
        return max(self.nodes) + 1 if self.nodes else 0

    def ranks_on(self, node: int) -> list[int]:
        """Group ranks on ``node``, ascending."""
        return [r for r, k in enumerate(self.nodes) if k == node]

    @property
    def counts(self) -> list[int]:
        return [len(self.ranks_on(k)) for k in range(self.n_nodes)]

    @property
    def uniform(self) -> bool:
        """True when every node holds the same number of the group's ranks."""
        return len(set(self.counts)) <= 1

    @property
    def two_level(self) -> bool:
        """True when a two-level collective differs from the flat one and applies."""
        return self.n_nodes > 1 and self.uniform and self.counts[0] > 1

    def column_order(self) -> list[int]:
        """Group ranks ordered by (local index, node): the block order of two-level stages."""
        per = [self.ranks_on(k) for k in range(self.n_nodes)]
        return [per[k][i] for i in range(len(per[0])) for k in range(self.n_nodes)]

    def host(self, node: int) -> str:
        return self.hosts[node] if node < len(self.hosts) else f"node{node}"


def node_ids(keys: Sequence[Any]) -> tuple[int, ...]:
    """Node index of each rank from any per-rank node key (host name, leader rank). Pure.

    Nodes are numbered in the order of their first rank: ``node_ids(["b", "a", "b"]) ==
    (0, 1, 0)``.
    """
    seen: dict[Any, int] = {}
    return tuple(seen.setdefault(k, len(seen)) for k in keys)


def default_algorithm() -> str:
    """``MPIDIST_COLLECTIVES`` (auto, flat or hierarchical; default auto)."""
    value = os.environ.get("MPIDIST_COLLECTIVES", "auto").strip().lower() or "auto"
    if value not in ALGORITHMS:
        raise ValueError(f"MPIDIST_COLLECTIVES={value!r} is not one of {ALGORITHMS}")
    return value


def hierarchical_min_bytes() -> int:
    """``MPIDIST_HIERARCHICAL_MIN_BYTES``: the smallest message ``auto`` sends in two levels."""
    return _env_int("MPIDIST_HIERARCHICAL_MIN_BYTES", _DEFAULT_MIN_BYTES, 0)


def _env_int(name: str, default: int, minimum: int) -> int:
    """The integer setting ``name`` (``default`` when unset); a ValueError naming it when it
    is not an integer or is below ``minimum``."""
    raw = os.environ.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def check_algorithm(algorithm: str | None) -> str:
    """The algorithm to use: ``algorithm``, or the environment's default when None."""
    if algorithm is None:
        return default_algorithm()
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not one of {ALGORITHMS}")
    return algorithm


# -- the cached topology of a communicator ------------------------------------------------
class Topology:
    """A group's node map and its two sub-communicators (made lazily, collectively)."""

    def __init__(self, comm: Any, nodes: NodeMap) -> None:
        self.map = nodes
        self.rank = comm.Get_rank()
        self.node = nodes.nodes[self.rank]
        self.local_index = nodes.ranks_on(self.node).index(self.rank)
        self._comm = comm
        self._subs: tuple[Any, Any] | None = None
        self._seq = 0

    def next_seq(self) -> int:
        """A number for the next two-level collective, the same on every rank (they start
        collectives in the same order); it keeps the tags of those in flight apart."""
        self._seq = (self._seq + 1) % 4096
        return self._seq

    def subcomms(self) -> tuple[Any, Any]:
        """(node, cross) communicators. Collective over the group the first time."""
        if self._subs is None:
            node = self._comm.Split(self.node, self.rank)
            cross = self._comm.Split(self.local_index, self.node)
            self._subs = (node, cross)
        return self._subs

    def free(self) -> None:
        if self._subs is not None:
            for c in self._subs:
                c.Free()
            self._subs = None


_KEYVAL: Any = None


def _keyval() -> int:
    global _KEYVAL
    if _KEYVAL is None:
        from mpi4py import MPI

        def delete(comm: Any, keyval: int, topo: Topology) -> None:
            # The sub-communicators belong to the communicator being freed.
            topo.free()

        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=delete)
    return _KEYVAL


def _detect(comm: Any) -> NodeMap:
    """Node map of ``comm`` from shared-memory domains. Collective over ``comm``."""
    from mpi4py import MPI

    shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
    # The node's lowest group rank names it (the same on all its ranks).
    leader = np.array([comm.Get_rank() if shared.Get_rank() == 0 else -1], dtype=np.int64)
    shared.Allreduce(MPI.IN_PLACE, leader, op=MPI.MAX)
    shared.Free()
    name = MPI.Get_processor_name().encode()[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0")
    mine = np.zeros(_NAME_BYTES + 8, dtype=np.uint8)
    mine[:8] = leader.view(np.uint8)
    mine[8:] = np.frombuffer(name, dtype=np.uint8)
    every = np.empty((comm.Get_size(), _NAME_BYTES + 8), dtype=np.uint8)
    comm.Allgather(mine, every)
    leaders = every[:, :8].copy().view(np.int64).ravel().tolist()
    ids = node_ids(leaders)
    hosts: list[str] = [""] * (max(ids) + 1)
    for r, k in enumerate(ids):
        if not hosts[k]:
            hosts[k] = bytes(every[r, 8:]).rstrip(b"\0").decode(errors="replace")
    return NodeMap(ids, tuple(hosts))


def topology(comm: Any) -> Topology:
    """The cached :class:`Topology` of ``comm``. Collective over ``comm`` the first time."""
    kv = _keyval()
    topo = comm.Get_attr(kv)
    if topo is None:
        topo = Topology(comm, _detect(comm))
        comm.Set_attr(kv, topo)
    return topo


def set_node_map(comm: Any, nodes: Sequence[int] | NodeMap) -> Topology:
    """Declare the node of each rank of ``comm`` instead of detecting it. Not collective.

    For tests and for machines whose shared-memory domains are not the nodes that matter
    (every rank must declare the same map before the next collective on ``comm``).
    """
    nm = nodes if isinstance(nodes, NodeMap) else NodeMap(node_ids(list(nodes)))
    if len(nm.nodes) != comm.Get_size():
        raise ValueError(
            f"a node map of {len(nm.nodes)} ranks does not fit a group of {comm.Get_size()}"
        )
    kv = _keyval()
    if comm.Get_attr(kv) is not None:
        comm.Delete_attr(kv)
    topo = Topology(comm, nm)
    comm.Set_attr(kv, topo)
    return topo


def _tags_fit(comm: Any) -> bool:
    from mpi4py import MPI

    ub = comm.Get_attr(MPI.TAG_UB)
    return ub is not None and ub >= 2**30 - 1


def choose_algorithm(comm: Any, nbytes: int, algorithm: str | None = None) -> Topology | None:
    """The topology to run a two-level collective on, or None for the flat one.

    Collective over ``comm`` when it needs the node map for the first time; every rank
    reaches the same answer (same sizes, same map, same settings). Flat where the group is
    on one node, has one rank per node or nodes of different sizes, or where the MPI
    library's largest tag is below 2**30 (the stages tag their messages).
    """
    algo = check_algorithm(algorithm)
    if algo == "flat" or comm is None or comm.Get_size() < 3 or not _tags_fit(comm):
        return None
    if algo == "auto" and nbytes < hierarchical_min_bytes():
        return None
    topo = topology(comm)
    return topo if topo.map.two_level else None


# -- stages -------------------------------------------------------------------------------
Stages = Iterator[list[Any]]


def chunk_bytes() -> int:
    """``MPIDIST_HIERARCHICAL_CHUNK_BYTES``: the pipeline's piece size (default 512 KiB).

    An allreduce goes through five steps per piece, reduce-scatter and allgather through
    three, which take pieces of twice this size (measured best on the virtual cluster:
    smaller pieces fill and drain the longer pipeline sooner, larger ones keep the messages
    of the shorter one large)."""
    return _env_int("MPIDIST_HIERARCHICAL_CHUNK_BYTES", _DEFAULT_CHUNK_BYTES, 1024)


def _bounds(m: int, itemsize: int, multiple: int, scale: int = 1) -> list[tuple[int, int]]:
    """Pieces [a, b) of m elements of about ``scale * chunk_bytes()`` each, lengths a
    multiple of ``multiple`` except the last."""
    step = max(multiple, scale * chunk_bytes() // itemsize // multiple * multiple)
    return [(a, min(a + step, m)) for a in range(0, m, step)] or [(0, 0)]


_REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum}


class _Exchange:
    """Point-to-point steps of one two-level collective, with tags of its own.

    Stages use tagged ``Isend``/``Irecv`` rather than nonblocking collectives: messages of
    different collectives in flight at once (DDP buckets, ZeRO units) then match by tag,
    whatever order the ranks advance them in.
    """

    def __init__(self, topo: Topology) -> None:
        self.node, self.cross = topo.subcomms()
        self.seq = topo.next_seq()

    def tag(self, phase: int, piece: int) -> int:
        return (self.seq << 18) | (phase << 16) | (piece & 0xFFFF)

    def scatter(self, comm: Any, blocks: np.ndarray, tag: int) -> tuple[list[Any], np.ndarray]:
        """Send block k of ``blocks`` (P, ...) to rank k; receive the others' block of mine."""
        me, size = comm.Get_rank(), comm.Get_size()
        got = np.empty((size,) + blocks.shape[1:], dtype=blocks.dtype)
        reqs = []
        for k in range(size):
            if k != me:
                reqs.append(comm.Irecv(got[k], source=k, tag=tag))
                reqs.append(comm.Isend(blocks[k], dest=k, tag=tag))
        got[me] = blocks[me]
        return reqs, got

    def gather(self, comm: Any, mine: np.ndarray, out: np.ndarray, tag: int) -> list[Any]:
        """Send ``mine`` to every rank; receive rank k's into ``out[k]``."""
        me, size = comm.Get_rank(), comm.Get_size()
        reqs = []
        for k in range(size):
            if k != me:
                reqs.append(comm.Irecv(out[k], source=k, tag=tag))
                reqs.append(comm.Isend(mine, dest=k, tag=tag))
        out[me] = mine
        return reqs


def _reduce(got: np.ndarray, op: str, out: np.ndarray | None = None) -> np.ndarray:
    """Reduce over the first axis in rank order (the same order on every rank)."""
    acc = np.array(got[0], copy=True) if out is None else out
    if out is not None:
        acc[...] = got[0]
    for k in range(1, got.shape[0]):
        _REDUCE[op](acc, got[k], out=acc)
    return acc


def _pipeline(n_pieces: int, steps: list[Any]) -> Stages:
    """Run ``steps[j](piece)`` (each returns requests) as a software pipeline: at stage t,
    step j works on piece t - j, so the link and shared memory overlap."""
    for t in range(n_pieces + len(steps) - 1):
        reqs: list[Any] = []
        for j, step in enumerate(steps):
            if 0 <= t - j < n_pieces:
                reqs += step(t - j)
        yield reqs


def allreduce_stages(x: np.ndarray, op: str, topo: Topology) -> Stages:
    """In-place two-level allreduce of the flat host array ``x`` (op sum, max or min).

    Each piece, padded to L*N*q elements and seen as (L, N, q): local rank i reduces slab i
    inside the node, then [i, k] across the nodes on node k, then the pieces travel back:
    allgather across the nodes, then inside the node.
    """
    ex = _Exchange(topo)
    n_local, n_nodes = ex.node.Get_size(), ex.cross.Get_size()
    n = n_local * n_nodes
    pieces = _bounds(x.shape[0], x.itemsize, n)
    st: dict[int, dict[str, Any]] = {}

    def inside_rs(j: int) -> list[Any]:
        a, b = pieces[j]
        q = -(-(b - a) // n)
        full = x[a:b]
        if (b - a) % n:
            full = np.zeros(q * n, dtype=x.dtype)
            full[: b - a] = x[a:b]
        reqs, got = ex.scatter(ex.node, full.reshape(n_local, n_nodes, q), ex.tag(0, j))
        st[j] = {"full": full, "got": got, "q": q}
        return reqs

    def across_rs(j: int) -> list[Any]:
        slab = _reduce(st[j].pop("got"), op)  # (N, q): this node's sums of slab li
        reqs, got = ex.scatter(ex.cross, slab, ex.tag(1, j))
        st[j]["got"] = got
        return reqs

    def across_ag(j: int) -> list[Any]:
        mine = _reduce(st[j].pop("got"), op)  # (q,): the total of block [li, ki]
        st[j]["row"] = np.empty((n_nodes, st[j]["q"]), dtype=x.dtype)
        return ex.gather(ex.cross, mine, st[j]["row"], ex.tag(2, j))

    def inside_ag(j: int) -> list[Any]:
        full = st[j]["full"].reshape(n_local, n_nodes, -1)
        return ex.gather(ex.node, st[j].pop("row"), full, ex.tag(3, j))

    def finish(j: int) -> list[Any]:
        a, b = pieces[j]
        full = st.pop(j)["full"]
        if full.shape[0] != b - a:
            x[a:b] = full[: b - a]
        return []

    yield from _pipeline(len(pieces), [inside_rs, across_rs, across_ag, inside_ag, finish])


def reduce_scatter_stages(send: np.ndarray, out: np.ndarray, op: str, topo: Topology) -> Stages:
    """Two-level reduce-scatter of ``send`` (length n*s, group order) into ``out`` (s),
    pipelined in pieces of the shard."""
    ex = _Exchange(topo)
    order = topo.map.column_order()
    n_local, n_nodes = ex.node.Get_size(), ex.cross.Get_size()
    n, s = len(order), out.shape[0]
    blocks = send.reshape(n, s)
    pieces = _bounds(s, send.itemsize * n, 1, 2)  # a piece: w elements of each of n blocks
    got: dict[int, np.ndarray] = {}

    def inside(j: int) -> list[Any]:
        a, b = pieces[j]
        piece = blocks[order, a:b].reshape(n_local, n_nodes, b - a)
        reqs, got[j] = ex.scatter(ex.node, piece, ex.tag(0, j))
        return reqs

    def across(j: int) -> list[Any]:
        reqs, got[j] = ex.scatter(ex.cross, _reduce(got[j], op), ex.tag(1, j))
        return reqs

    def finish(j: int) -> list[Any]:
        a, b = pieces[j]
        _reduce(got.pop(j), op, out=out[a:b])
        return []

    yield from _pipeline(len(pieces), [inside, across, finish])


def allgather_stages(shard: np.ndarray, out: np.ndarray, topo: Topology) -> Stages:
    """Two-level allgather of ``shard`` (s) from every rank into ``out`` (n*s, group order),
    pipelined in pieces of the shard.

    ``shard`` may be a view of ``out`` (the in-place form): it is copied before any of
    ``out`` is written.
    """
    ex = _Exchange(topo)
    order = topo.map.column_order()
    n_local, n_nodes = ex.node.Get_size(), ex.cross.Get_size()
    n, s = len(order), shard.shape[0]
    pieces = _bounds(s, shard.itemsize * n, 1, 2)  # a piece: w elements of each of n blocks
    mine = shard.copy() if np.shares_memory(shard, out) else shard
    blocks = out.reshape(n, s)
    cols: dict[int, np.ndarray] = {}
    grids: dict[int, np.ndarray] = {}

    def across(j: int) -> list[Any]:
        a, b = pieces[j]
        cols[j] = np.empty((n_nodes, b - a), dtype=shard.dtype)
        return ex.gather(ex.cross, mine[a:b], cols[j], ex.tag(0, j))

    def inside(j: int) -> list[Any]:
        grids[j] = np.empty((n_local, n_nodes, cols[j].shape[1]), dtype=shard.dtype)
        return ex.gather(ex.node, cols.pop(j), grids[j], ex.tag(1, j))

    def place(j: int) -> list[Any]:
        a, b = pieces[j]
        blocks[order, a:b] = grids.pop(j).reshape(n, b - a)
        return []

    yield from _pipeline(len(pieces), [across, inside, place])
