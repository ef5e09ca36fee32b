"""Pipeline schedules as orders of operations, and a simulator that predicts their step.

An operation is ``(kind, micro-batch, chunk)``: ``"F"`` a forward, ``"B"`` the input
gradient, ``"W"`` the weight gradients, ``"BW"`` a whole backward (both at once). A stage
of ``p`` holds ``v`` chunks (virtual stages ``chunk * p + stage``; ``v = 1`` but for the
interleaved schedule). Schedules:

* ``gpipe`` — every forward, then every backward;
* ``1f1b`` — ``p - s - 1`` warm-up forwards on stage ``s``, then one forward one backward;
* ``interleaved`` — Megatron's interleaved 1F1B over ``v`` chunks per stage (needs ``m`` a
  multiple of ``p``): the bubble shrinks by ``v``;
* ``zero-bubble`` — ZB-H1 (Qi et al., 2024): backward split into B and W, W deferred into
  the bubble, memory no more than 1F1B's. A micro-batch is held from its F to its W (a
  pending W keeps the weight products' inputs and upstream gradients: almost all of the
  activations), and no stage holds more than ``min(p, m)``, 1F1B's peak (stage 0's). Stage
  ``s`` runs ``p - s`` warm-up forwards, then for each micro-batch its B, the W of the
  micro-batch ``s`` before it (so ``s`` W wait, filling the bubble), the next forward; the
  ``s`` deferred W last. With equal F, B and W and free messages the step is
  ``3m + p - 1`` (``2m + 2p - 1`` for ``m < p``), the lower bound of any order.

:func:`simulate` runs orders against per-chunk times of F, B and W and a point-to-point
latency, honouring every dependency (a forward needs the previous virtual stage's, a B the
next one's, a W its own B) and each stage's order; the planner and the pipeline benchmark
predict steps with it. Everything here is pure.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SCHEDULES", "Simulation", "orders", "peak_in_flight", "simulate", "step_units"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")

Op = tuple[str, int, int]


def _check(schedule: str, p: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    for name, value in (("pp", p), ("micro_batches", m), ("virtual_stages", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if v > 1 and schedule != "interleaved":
        raise ValueError(f"virtual_stages={v} needs schedule 'interleaved' (got {schedule!r})")
    if schedule == "interleaved" and m % p:
        raise ValueError(f"the interleaved schedule needs micro_batches a multiple of "
                         f"pp={p}; got micro_batches={m}")


def _interleaved(stage: int, p: int, m: int, v: int) -> list[Op]:
    total = m * v

    def op(kind: str, k: int) -> Op:
        chunk = (k // p) % v
        micro = (k // (p * v)) * p + k % p
        return kind, micro, chunk if kind == "F" else v - 1 - chunk

    warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
    out = [op("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [op("F", warmup + k), op("BW", k)]
    return out + [op("BW", k) for k in range(total - warmup, total)]


def orders(schedule: str, p: int, m: int, v: int = 1) -> list[list[Op]]:
    """Every stage's operations in the order it runs them. Pure; ValueError for a schedule
    that cannot run (``interleaved`` with ``m`` not a multiple of ``p``)."""
    _check(schedule, p, m, v)
    if schedule == "gpipe":
        return [[("F", i, 0) for i in range(m)] + [("BW", i, 0) for i in range(m)]
                for _ in range(p)]
    if schedule == "1f1b":
        out = []
        for s in range(p):
            warm = min(p - s - 1, m)
            order = [("F", i, 0) for i in range(warm)]
            for k in range(m - warm):
                order += [("F", warm + k, 0), ("BW", k, 0)]
            out.append(order + [("BW", i, 0) for i in range(m - warm, m)])
        return out
    if schedule == "interleaved":
        return [_interleaved(s, p, m, v) for s in range(p)]
    return _zero_bubble(p, m)


def step_units(schedule: str, p: int, m: int, v: int = 1) -> float:
    """A step's time in units of one micro-batch's F on one stage, with B = W = F and free
    messages: the closed forms the simulation gives (tested against it), for the planner.
    GPipe and 1F1B ``3(m + p - 1)``; interleaved ``3(m + (p - 1)/v)``; ZB-H1
    ``3m + p - 1``, or ``2m + 2p - 1`` for ``m < p`` (the first B reaches stage 0 after
    ``2p - 1`` units, then ``2m`` units of B and W remain there). Pure."""
    _check(schedule, p, m, v)
    if schedule == "zero-bubble":
        return 2 * m + p - 1 + max(m, p)
    if schedule == "interleaved":
        return 3 * (m + (p - 1) / v)
    return 3 * (m + p - 1)


def peak_in_flight(schedule: str, p: int, m: int, v: int = 1) -> int:
    """The most (micro-batch, chunk) pairs between their forward and their backward (under
    ZB-H1 their W, the end of the backward) on any stage of ``schedule``'s orders (a chunk is
    ``1/v`` of a stage): GPipe ``m``, 1F1B and ZB-H1 ``min(p, m)`` (their closed forms),
    interleaved counted on its orders. Pure."""
    _check(schedule, p, m, v)
    if schedule == "gpipe":
        return m
    if schedule != "interleaved":
        return min(p, m)
    peak = 0
    for order in orders(schedule, p, m, v):
        live = 0
        for kind, _, _ in order:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
    return peak


@dataclass
class Simulation:
    """What :func:`simulate` predicts: the step's time, each stage's busy time, and the
    bubble (idle fraction of the step, averaged over the stages)."""

    step: float
    busy: list[float]

    @property
    def bubble(self) -> float:
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step) if self.step else 0.0


def _cost(kind: str, f: float, b: float, w: float) -> float:
    return {"F": f, "B": b, "W": w, "BW": b + w}[kind]


def simulate(stage_orders: list[list[Op]], *, f: float, b: float, w: float,
             comm: float = 0.0) -> Simulation:
    """Run ``stage_orders`` (one list per stage) with per-chunk times ``f``, ``b``, ``w``
    of a forward, an input gradient and a weight gradient, and ``comm`` seconds per
    point-to-point message between stages. ValueError if the orders deadlock."""
    p = len(stage_orders)
    v = 1 + max((c for order in stage_orders for _, _, c in order), default=0)
    last = p * v - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro, virtual stage) -> end
    free, busy, pos = [0.0] * p, [0.0] * p, [0] * p
    while any(pos[s] < len(stage_orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(stage_orders[s]):
                kind, i, c = stage_orders[s][pos[s]]
                vs = c * p + s
                ready = _ready(kind, i, vs, last, p, done, comm)
                if ready is None:
                    break
                start = max(free[s], ready)
                cost = _cost(kind, f, b, w)
                free[s] = start + cost
                busy[s] += cost
                for k in ("B", "W") if kind == "BW" else (kind,):
                    done[(k, i, vs)] = free[s]
                pos[s] += 1
                moved = True
        if not moved:
            raise ValueError("the stage orders deadlock: " + ", ".join(
                f"stage {s} waits at {stage_orders[s][pos[s]]}" for s in range(p)
                if pos[s] < len(stage_orders[s])))
    return Simulation(max(free), busy)


def _ready(kind: str, i: int, vs: int, last: int, p: int,
           done: dict[tuple[str, int, int], float], comm: float) -> float | None:
    """When operation ``kind`` of micro-batch ``i`` on virtual stage ``vs`` may start
    (None: its input is not computed yet)."""
    def after(key: tuple[str, int, int], across: bool) -> float | None:
        t = done.get(key)
        return None if t is None else t + (comm if across else 0.0)

    if kind == "F":
        return 0.0 if vs == 0 else after(("F", i, vs - 1), p > 1)
    if kind == "W":
        return after(("B", i, vs), False)
    own = after(("F", i, vs), False)
    if own is None:
        return None
    if vs == last:
        return own
    nxt = after(("B", i, vs + 1), p > 1)
    return None if nxt is None else max(own, nxt)


def _zero_bubble(p: int, m: int) -> list[list[Op]]:
    """ZB-H1's orders (the module doc): stage ``s`` holds at most ``p - s`` micro-batches
    between F and B and ``s`` more waiting for their W, ``min(p, m)`` in all."""
    out = []
    for s in range(p):
        n_f = min(p - s, m)
        order: list[Op] = [("F", i, 0) for i in range(n_f)]
        for j in range(m):
            order.append(("B", j, 0))
            if j >= s:
                order.append(("W", j - s, 0))
            if n_f < m:
                order.append(("F", n_f, 0))
                n_f += 1
        out.append(order + [("W", i, 0) for i in range(max(0, m - s), m)])
    return out
