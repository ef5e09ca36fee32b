"""The pure arithmetic of elastic resizing: the agreed decision and the transfer plan.

Nothing here communicates; :mod:`mpidist.parallel.elastic` runs it on every worker with the
same numbers, so every worker takes the same decision and the plans of all members fit
together (what member i sends to j is what j expects from i).

A mesh of ``n`` workers has dims (pp, dp, tp), tp fastest (:func:`mpidist.core.mesh.layout`):
``rank = (stage*dp + d)*tp + t`` with ``dp = n // (pp*tp)``. A **column** is one
(stage, tp rank) pair, numbered ``stage*tp + t``: its ``dp`` ranks hold the same tensors
(those of the stage, in tp rank t's slices), sharded or replicated over dp. A resize keeps
pp and tp and changes dp, so a worker may land in another column; every column's elements
move from their old holders to their new ones, within the column.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mpidist.core.buffers import shard_range

__all__ = ["Plan", "ResizeDecision", "column_of", "decide", "membership", "owned",
           "transfer_plan"]


@dataclass(frozen=True)
class ResizeDecision:
    """What the workers agreed on at a step boundary (identical on every worker)."""

    n_old: int
    leavers: tuple[int, ...]
    joins: int
    refused: str | None = None

    @property
    def n_new(self) -> int:
        return self.n_old - len(self.leavers) + self.joins

    @property
    def changes(self) -> bool:
        return self.refused is None and (bool(self.leavers) or self.joins > 0)

    @property
    def kind(self) -> str:
        if self.leavers and self.joins:
            return "resize"
        return "leave" if self.leavers else "join"


def decide(vector: Sequence[int], n_old: int, min_workers: int, max_workers: int, *,
           pp: int = 1, tp: int = 1) -> ResizeDecision:
    """The membership change encoded in the reduced request vector. Pure.

    ``vector[:n_old]`` are leave flags by rank; ``vector[n_old]`` is the largest requested
    world size (0: none). A requested size below the size after the leaves turns into
    leaves of the highest ranks; above, into joins. A result outside
    ``[min_workers, max_workers]``, or not a multiple of ``pp*tp`` (the data-parallel size
    changes by whole pipeline x tensor groups), is refused as a whole, with the reason.
    """
    flags = [r for r in range(n_old) if vector[r]]
    target = int(vector[n_old])
    after_leaves = n_old - len(flags)
    joins = 0
    leavers = list(flags)
    if target > 0:
        if target > after_leaves:
            joins = target - after_leaves
        elif target < after_leaves:
            stay = [r for r in range(n_old) if r not in flags]
            leavers = sorted(flags + stay[target:])
    d = ResizeDecision(n_old, tuple(leavers), joins)
    if not d.changes:
        return d
    n_new = d.n_new
    why = None
    if n_new < min_workers:
        why = (f"refused: the change {n_old} -> {n_new} workers (leaving ranks "
               f"{list(leavers)}) would go below min_workers={min_workers}")
    elif n_new > max_workers:
        why = (f"refused: the change {n_old} -> {n_new} workers would go above "
               f"max_workers={max_workers}")
    elif n_new % (pp * tp):
        why = (f"refused: the change {n_old} -> {n_new} workers (leaving ranks "
               f"{list(leavers)}, {joins} joining) gives {n_new} workers, not a multiple of "
               f"pipeline_parallel_size={pp} x tensor_parallel_size={tp} = {pp * tp}: the "
               "data-parallel size changes by whole pipeline x tensor groups")
    return d if why is None else ResizeDecision(n_old, tuple(leavers), joins, refused=why)


def membership(d: ResizeDecision) -> tuple[list[int], list[int]]:
    """``(old_ranks, new_ranks)`` of every member of the union communicator (old workers
    first, then joiners), -1 where a member has no rank. Pure."""
    left = set(d.leavers)
    old = list(range(d.n_old)) + [-1] * d.joins
    new, nxt = [], 0
    for i in range(d.n_old + d.joins):
        if i < d.n_old and i in left:
            new.append(-1)
        else:
            new.append(nxt)
            nxt += 1
    return old, new


def owned(numel: int, n: int, r: int) -> tuple[int, int]:
    """The unpadded elements ``[start, stop)`` of a ``numel``-element unit that shard ``r``
    of ``n`` holds (empty ranges at the end are clipped). Pure."""
    start, stop = shard_range(numel, r, n)
    return min(start, numel), min(stop, numel)


def column_of(rank: int, world_size: int, pp: int = 1, tp: int = 1) -> tuple[int, int]:
    """``(column, dp index)`` of ``rank`` in a mesh of ``world_size`` workers: the column
    is ``stage*tp + t`` (see the module doc). Pure; ValueError for a bad size."""
    if world_size % (pp * tp) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} of world_size={world_size} is not in a mesh with "
                         f"pp={pp}, tp={tp}")
    dp = world_size // (pp * tp)
    stage, rest = divmod(rank, dp * tp)
    d, t = divmod(rest, tp)
    return stage * tp + t, d


Plan = list[list[tuple[int, int, int]]]  # per peer: (unit, start, stop) in unit elements


def transfer_plan(numels: Sequence[int] | Mapping[int, Sequence[int]], n_old: int, n_new: int,
                  old_ranks: Sequence[int], new_ranks: Sequence[int], me: int, *,
                  sharded: bool, pp: int = 1, tp: int = 1) -> tuple[Plan, Plan]:
    """What member ``me`` of the union sends to and receives from every member. Pure.

    ``numels`` are the unit sizes of a column's tensors: one list (every column alike:
    pp=tp=1), or ``{column: list}`` holding at least the columns ``me`` is in before and
    after. Ranges are in each unit's unpadded element index, and only members of the same
    column (before for the sender, after for the receiver) exchange. A sharded buffer: the
    old owner of an element sends it to its new owner. A replicated buffer: members that
    stay in their column keep theirs (re-laid-out locally); a joiner, or a member moving to
    another column, gets every element of its new column from its old owner there, so the
    column's old workers share the sending evenly.
    """
    size = len(old_ranks)
    group = pp * tp
    dp_old, dp_new = n_old // group, n_new // group
    olds = [None if r < 0 else column_of(r, n_old, pp, tp) for r in old_ranks]
    news = [None if r < 0 else column_of(r, n_new, pp, tp) for r in new_ranks]

    def sizes(column: int) -> Sequence[int]:
        return numels[column] if isinstance(numels, Mapping) else numels

    def need(j: int, numel: int) -> tuple[int, int] | None:
        new, old = news[j], olds[j]
        if new is None:
            return None
        if sharded:
            return owned(numel, dp_new, new[1])
        return (0, numel) if old is None or old[0] != new[0] else None

    def inter(i: int, j: int) -> list[tuple[int, int, int]]:
        old, new = olds[i], news[j]
        if old is None or new is None or old[0] != new[0]:
            return []
        out = []
        for u, numel in enumerate(sizes(old[0])):
            h, w = owned(numel, dp_old, old[1]), need(j, numel)
            if w is None:
                continue
            a, b = max(h[0], w[0]), min(h[1], w[1])
            if a < b:
                out.append((u, a, b))
        return out

    sends = [inter(me, j) for j in range(size)]
    recvs = [inter(i, me) for i in range(size)]
    return sends, recvs
