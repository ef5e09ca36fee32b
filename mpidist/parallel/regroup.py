"""In-job recovery on meshes with pipeline or tensor parallelism: the mesh the survivors go on
with, whose state covers whom, and the state gathered as named global tensors.

:mod:`mpidist.parallel.recovery` uses this module where the old mesh has ``pp > 1`` or
``tp > 1`` (or orders its data-parallel ranks otherwise than the run's communicator). Ranks
are matched by their **mesh coordinates**: old rank ``i`` of the run's communicator is rank
``cart_of[i]`` of the mesh (whose coordinates are :func:`mpidist.core.mesh.layout`'s), so a
placement that numbers the mesh in another order than the launcher (``mpirun --map-by
node``) is handled like any other.

* **The new mesh** (:func:`choose_mesh`): ``m`` survivors keep pp and tp where ``m >= pp*tp``
  (``dp' = m // (pp*tp)``); otherwise the first of (pp, 1), (1, tp), (1, 1) that fits: tensor
  parallelism goes first (it needs the fastest links and splits the least memory), then the
  pipeline. Each candidate keeps sizes the model was already validated at (or 1), so the
  model accepts it. The ``pp'*tp'*dp'`` lowest survivors go on (the lowest survivor stays
  rank 0); the others are **released**: they give their state and copies to the gathering,
  hold nothing afterwards, and wait (without work) for the job's end, where they exit with
  the others' status (``mpidist train`` returns them as a rank that left, like an elastic
  leaver). They are not given work because every size they could join at changes pp or tp
  again; a job that grows back brings them in at a step boundary.
* **Coverage** (:func:`holder_map`, :func:`uncovered`): a dead rank's state is still there
  when a survivor of its column has it (DDP with dp >= 2: a replica), or when the holder of
  its copy (:mod:`mpidist.parallel.redundancy`: the buddy in the column's dp group at ZeRO,
  the next mesh rank where dp == 1) is alive and holds the step's copy.
* **Redistribution** (:func:`gather_named`): every survivor contributes what it holds (its own
  state at the start of the step, through its placement; the copies it holds for dead ranks,
  through their manifests) as pieces of named global tensors; one ``Allgatherv`` over the
  survivors gives every survivor the whole model's parameters and optimizer state as named
  global tensors, which the rebuilt model loads as it loads a checkpoint written at another
  mesh. Cost: each survivor receives every piece of every survivor (the whole model state,
  with the replicated tensors as often as they are held) and keeps the named tensors (the
  model's parameters and optimizer state, unsharded) for the duration of the rebuild. A
  plan that sends each element once to its new owner (as :mod:`mpidist.parallel.resize` does
  within a column) would cut that to the moved shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpidist.core.comms import mpi
from mpidist.core.failure import keep_alive

__all__ = ["assemble", "choose_mesh", "column_survivors", "gather_named", "holder_map",
           "mesh_ranks", "uncovered"]


def mesh_ranks(top: Any, mesh: Any) -> list[int]:
    """``cart_of[i]``: the rank in ``mesh`` of rank ``i`` of ``top`` (two communicators of
    the same processes; the mesh may number them by node). The identity where ``top`` is
    None or the two differ in members. Local (group arithmetic, no communication)."""
    if top is None:
        return list(range(mesh.Get_size()))
    n = top.Get_size()
    if n != mesh.Get_size():
        return list(range(n))
    g_top, g_mesh = top.Get_group(), mesh.Get_group()
    try:
        out = mpi().Group.Translate_ranks(g_top, list(range(n)), g_mesh)
    finally:
        g_top.Free()
        g_mesh.Free()
    out = [int(r) for r in out]
    return out if sorted(out) == list(range(n)) else list(range(n))


def choose_mesh(m: int, pp: int, tp: int) -> tuple[int, int, int]:
    """``(pp', tp', dp')`` for ``m >= 1`` survivors of a (pp, ·, tp) mesh (see the module
    doc); ``pp'*tp'*dp' <= m`` ranks go on. Pure; ValueError when ``m < 1``."""
    if m < 1:
        raise ValueError(f"m={m} survivors: at least one is needed")
    for p, t in ((pp, tp), (pp, 1), (1, tp), (1, 1)):
        if p * t <= m:
            return p, t, m // (p * t)
    raise AssertionError("unreachable: (1, 1) always fits")  # pragma: no cover


def _coords(c: int, pp: int, dp: int, tp: int) -> tuple[int, int, int]:
    """(stage, dp index, tp index) of mesh rank ``c`` (dims (pp, dp, tp), tp fastest)."""
    s, rest = divmod(c, dp * tp)
    d, t = divmod(rest, tp)
    return s, d, t


def holder_map(pp: int, dp: int, tp: int, level: int, cart_of: Sequence[int],
               stride: int = 1) -> dict[int, int]:
    """Rank (in the run's communicator) -> the rank that holds its copy, for every rank
    whose state has a copy elsewhere than in its column's replicas: at ZeRO with dp >= 2,
    the dp index ``stride`` further in its column; with dp == 1, the mesh rank ``stride``
    further (:func:`mpidist.parallel.redundancy.copy_stride`). Empty at DDP with dp >= 2
    (replicas). ``cart_of[i]``: the mesh rank of rank ``i``. Pure."""
    n = pp * dp * tp
    top_of = {c: i for i, c in enumerate(cart_of)}
    out: dict[int, int] = {}
    for i, c in enumerate(cart_of):
        if dp == 1:
            if n > 1:
                out[i] = top_of[(c + stride) % n]
        elif level >= 1:
            s, d, t = _coords(c, pp, dp, tp)
            out[i] = top_of[(s * dp + (d + stride) % dp) * tp + t]
    return out


def column_survivors(v: int, alive: Sequence[int], pp: int, dp: int, tp: int,
                     cart_of: Sequence[int]) -> list[int]:
    """The ranks in ``alive`` of rank ``v``'s (stage, tp) column. Pure."""
    s, _, t = _coords(cart_of[v], pp, dp, tp)
    out = []
    for r in alive:
        rs, _, rt = _coords(cart_of[r], pp, dp, tp)
        if (rs, rt) == (s, t):
            out.append(r)
    return out


def uncovered(dead: Sequence[int], survivors: Sequence[int], values: np.ndarray, tag: int, *,
              pp: int, dp: int, tp: int, level: int, cart_of: Sequence[int],
              stride: int = 1) -> tuple[int, int, str] | None:
    """The first dead rank whose state is gone, as ``(rank, holder, why)`` (``why``:
    ``"died"`` with it, or ``"stale"``: its copy does not hold step ``tag``), or None when
    every dead rank is covered. ``values[i]``: survivor i's reported row (its copy tags from
    index 3); ``stride``: the copies' (:func:`holder_map`). Pure."""
    holders = holder_map(pp, dp, tp, level, cart_of, stride)
    alive = list(survivors)
    for v in dead:
        if v not in holders:  # DDP replicas: any survivor of the column has it all
            if not column_survivors(v, alive, pp, dp, tp, cart_of):
                return v, -1, "died"
            continue
        h = holders[v]
        if h not in alive:
            return v, h, "died"
        if tag not in values[alive.index(h)][3:]:
            return v, h, "stale"
    return None


# -- the named global tensors ------------------------------------------------------------------
def _flatten(sources: Sequence[tuple[np.ndarray, Sequence[np.ndarray]]], dtype: Any
             ) -> tuple[np.ndarray, np.ndarray]:
    """``(meta rows (name, start, stop), data)`` of ``(manifest, buffers)`` sources."""
    metas, datas = [], []
    for rows, buffers in sources:
        if rows.size == 0:
            continue
        metas.append(rows[:, :3])
        for _, a, b, k, o in rows:
            datas.append(buffers[k][o:o + b - a])
    meta = np.concatenate(metas) if metas else np.zeros((0, 3), dtype=np.int64)
    data = np.concatenate(datas).astype(dtype, copy=False) if datas \
        else np.zeros(0, dtype=dtype)
    return np.ascontiguousarray(meta, dtype=np.int64), np.ascontiguousarray(data)


def gather_named(comm: Any, sources: Sequence[tuple[np.ndarray, Sequence[np.ndarray]]],
                 dtype: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """Every survivor's pieces: ``sources`` are ``(manifest, buffers)`` pairs (see
    :func:`mpidist.parallel.redundancy.manifest`). Returns ``(meta, data, bytes sent)``: all
    survivors' meta rows (name index, start, stop) and their data, in rank order.
    Collective over ``comm`` (an ``Allgather`` of the counts, two ``Allgatherv``)."""
    meta, data = _flatten(sources, dtype)
    counts = np.array([meta.shape[0], data.size], dtype=np.int64)
    table = np.zeros((comm.Get_size(), 2), dtype=np.int64)
    all_meta = np.zeros((0, 3), dtype=np.int64)
    all_data = np.zeros(0, dtype=dtype)
    try:
        comm.Allgather(counts, table)
        all_meta = np.zeros((int(table[:, 0].sum()), 3), dtype=np.int64)
        all_data = np.zeros(int(table[:, 1].sum()), dtype=dtype)
        rc, dc = (table[:, 0] * 3).tolist(), table[:, 1].tolist()
        comm.Allgatherv(meta.reshape(-1), [all_meta.reshape(-1), (rc, _displs(rc))])
        comm.Allgatherv(data, [all_data, (dc, _displs(dc))])
    except BaseException:
        keep_alive(meta, data, all_meta, all_data)  # a failed transfer may still touch them
        raise
    return all_meta, all_data, int(data.nbytes) * (comm.Get_size() - 1)


def _displs(counts: Sequence[int]) -> list[int]:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()


def assemble(names: Sequence[str], shapes: Sequence[tuple[int, ...]], meta: np.ndarray,
             data: np.ndarray) -> tuple[dict[str, np.ndarray], list[str]]:
    """The named global tensors from gathered pieces, and the names of those some element
    of which no piece covered (then the state is incomplete). Pure."""
    flat = [np.zeros(int(np.prod(s)), dtype=data.dtype) for s in shapes]
    seen = [np.zeros(f.size, dtype=bool) for f in flat]
    pos = 0
    for i, a, b in meta:
        flat[i][a:b] = data[pos:pos + b - a]
        seen[i][a:b] = True
        pos += b - a
    out = {n: f.reshape(s) for n, f, s in zip(names, flat, shapes, strict=True)}
    return out, [n for n, m in zip(names, seen, strict=True) if not m.all()]
