"""``mpidist plan``: which (pp, tp, dp, zero_stage) layouts fit a model on a cluster, and how fast.

Pure arithmetic, no MPI. For each layout the planner predicts per-device memory and the time
of one training step:

Model states (bytes per parameter, ZeRO paper section 3 and Megatron's distributed-optimizer
table): each device holds ``Ψ = params / (pp·tp)`` parameters with ``p`` bytes of parameter,
``g`` bytes of gradient and ``K`` bytes of optimizer state (fp32 master copies and moments):

====================  ========================================
stage 0 (DDP)         (p + g + K)·Ψ
stage 1 (optimizer)   (p + g)·Ψ + K·Ψ/dp
stage 2 (+gradients)  p·Ψ + (g + K)·Ψ/dp
stage 3 (+params)     (p + g + K)·Ψ/dp
====================  ========================================

With ``precision="mixed"`` and Adam (p=2, g=2, K=12), 7.5B parameters on 64 devices give the
ZeRO paper's 120, 31.4, 16.6 and 1.9 GB. Activations follow Korthikanti et al. (2022) for a
transformer layer without recomputation: ``s·b·h·(10 + 24/tp + 5·a·s/(h·tp))`` bytes in 16-bit
(doubled for fp32), times the layers of a pipeline stage and the micro-batches in flight
(``pp`` under 1F1B on the first stage, so ``L`` layers' worth in all).

Step time: compute ``6·params·tokens / (devices·flops·efficiency)`` stretched by the pipeline
bubble ``(pp-1)/m``, plus an alpha-beta cost for every collective (ring algorithms:
allreduce ``2(n-1)α + 2(n-1)/n·S/β``; reduce-scatter and allgather half of that), with the
intra-node link for a group that fits in a node. Two network levels: a group that spans
N nodes with L of its ranks on each runs mpidist's two-level collectives
(:mod:`mpidist.core.topology`): the intra-node part (a ring over L ranks) and the inter-node part
(every node sends ``(N-1)/N·S``, twice for allreduce, through its link of ``node_bw`` bytes/s
shared by all collectives of the same kind running on the node, and at most ``inter_bw`` per
device) run as a pipeline of pieces, so the slower of the two counts. Nothing else is
assumed overlapped, so the times are upper bounds for well-overlapped implementations.

Copies for in-job recovery (``--redundancy buddy``, :mod:`mpidist.parallel.redundancy`), in
host memory, not counted in what must fit on the device (``copies_gb``): with ``W`` bytes
of stored parameter (the fp32 master where there is one) and ``M`` of moments, DDP keeps a
snapshot of everything, ``(W + M)·Ψ``; ZeRO its shard's snapshot and a double-buffered copy
of its neighbour's, ``3·(W + M)·Ψ/dp``, plus the neighbour's gradient shard at stages 2-3,
``g·Ψ/dp``. With pp or tp > 1 (``Ψ`` then the device's share) the same holds within each
(stage, tp) column where dp >= 2; where dp is 1 the next rank of the mesh holds the whole
state, double-buffered: ``3·(W + M)·Ψ`` with the snapshot.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from mpidist.parallel.schedules import SCHEDULES, peak_in_flight, step_units

__all__ = [
    "PRECISIONS",
    "Cluster",
    "add_parser",
    "allgather_time",
    "allreduce_time",
    "group_time",
    "bytes_per_parameter",
    "copies_bytes",
    "main",
    "model_state_bytes",
    "parse_count",
    "plan",
    "reduce_scatter_time",
    "default_shape",
    "resolve_shape",
    "shape_line",
    "zero_sync_time",
]

GB = 1e9  # the ZeRO paper's and Megatron's GB

#: precision -> (parameter bytes, gradient bytes, master bytes kept by the optimizer,
#: bytes per optimizer-moment element, activation bytes per element)
PRECISIONS: dict[str, tuple[int, int, int, int, int]] = {
    # fp32 training: no master copy (Megatron: "fp32 param, fp32 grads": 16 -> 8 + 8/d)
    "fp32": (4, 4, 0, 4, 4),
    # 16-bit params and grads, fp32 master params and moments (ZeRO paper, K = 12)
    "mixed": (2, 2, 4, 4, 2),
    # Megatron: 16-bit params, fp32 grads (main grads): 18 -> 6 + 12/d
    "mixed-fp32-grads": (2, 4, 4, 4, 2),
    # Megatron: 16-bit params and grads, fp32 main params and main grads in the optimizer:
    # 20 -> 4 + 16/d
    "mixed-main-grads": (2, 2, 8, 4, 2),
    # float64 training (mpidist CPU runs)
    "fp64": (8, 8, 0, 8, 8),
}
# What mpidist's engine keeps under `mpidist train --precision mixed-bf16|mixed-fp16`:
# 16-bit compute parameters, float32 gradients (reduced in float32), float32 master
# weights (the optimizer's parameter storage) and float32 moments.
PRECISIONS["mixed-bf16"] = PRECISIONS["mixed-fp16"] = PRECISIONS["mixed-fp32-grads"]

# Hyperparameters the planner assumes where an optimizer's defaults keep less state than
# training uses: SGD with momentum ("sgd"); "sgd-plain" is SGD's defaults (no momentum).
_PLANNED: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("sgd", {"momentum": 0.9}), "sgd-plain": ("sgd", {}),
}


def _optimizer_moments() -> dict[str, int]:
    """optimizer -> per-element state buffers, from mpidist.optim's registry."""
    from mpidist import optim

    names = {name: (name, {}) for name in optim.OPTIMIZERS} | _PLANNED
    return {alias: len(optim.create(name, **hp).state_names())
            for alias, (name, hp) in names.items()}


#: optimizer -> number of per-element moment buffers (adam 2, sgd with momentum 1, ...)
OPTIMIZER_MOMENTS: dict[str, int] = _optimizer_moments()


def bytes_per_parameter(precision: str = "mixed", optimizer: str = "adam",
                        zero_stage: int = 0, dp: int = 1) -> float:
    """Model-state bytes per parameter on one device (see the module docstring)."""
    p, g, master, moment, _ = _precision(precision)
    k = master + moment * _moments(optimizer)
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp={dp!r} must be a positive integer")
    if zero_stage == 0:
        return float(p + g + k)
    if zero_stage == 1:
        return p + g + k / dp
    if zero_stage == 2:
        return p + (g + k) / dp
    return (p + g + k) / dp


def model_state_bytes(params: float, *, precision: str = "mixed", optimizer: str = "adam",
                      zero_stage: int = 0, dp: int = 1, tp: int = 1, pp: int = 1) -> float:
    """Model-state bytes on one device for ``params`` parameters split over tp·pp and
    sharded over dp according to ``zero_stage``."""
    return params / (tp * pp) * bytes_per_parameter(precision, optimizer, zero_stage, dp)


def copies_bytes(params: float, *, precision: str = "mixed", optimizer: str = "adam",
                 zero_stage: int = 0, dp: int = 1, tp: int = 1, pp: int = 1) -> float:
    """Host bytes of the copies in-job recovery keeps on one device (see the module
    docstring); ``params``: the device's share of the parameters."""
    p, g, master, moment, _ = _precision(precision)
    own = params * ((master or p) + moment * _moments(optimizer))
    if dp == 1 and tp * pp > 1:  # the next mesh rank holds the whole state
        return 3 * float(own)
    if zero_stage == 0:
        return float(own)
    if dp == 1:
        return own / dp
    grads = params * g / dp if zero_stage >= 2 else 0.0
    return 3 * own / dp + grads


def allreduce_time(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Ring allreduce of ``nbytes`` over ``n`` ranks; ``alpha`` s latency, ``beta`` B/s."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta


def reduce_scatter_time(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Ring reduce-scatter of a buffer of ``nbytes`` (the whole buffer, not the shard)."""
    if n <= 1:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * nbytes / beta


def allgather_time(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Ring allgather producing a buffer of ``nbytes``."""
    return reduce_scatter_time(nbytes, n, alpha, beta)


@dataclass(frozen=True)
class Cluster:
    """The machine the planner plans for.

    Attributes:
        devices: number of devices (GPUs, or CPU ranks).
        devices_per_node: devices sharing the fast intra-node link.
        memory_gb: memory per device (GB = 1e9 bytes).
        flops: peak FLOP/s per device; ``efficiency`` the achieved fraction.
        intra_bw, inter_bw: bytes/s per link within a node and between nodes.
        intra_latency, inter_latency: seconds per message.
        node_bw: bytes/s of one node's link to the others, shared by its devices (None:
            ``devices_per_node * inter_bw``, a network port per device).
        hierarchical: groups that span nodes use two-level collectives (mpidist's default
            for large messages); False models one flat ring over the inter-node link.
    """

    devices: int
    devices_per_node: int = 8
    memory_gb: float = 80.0
    flops: float = 312e12
    efficiency: float = 0.5
    intra_bw: float = 150e9
    intra_latency: float = 5e-6
    inter_bw: float = 25e9
    inter_latency: float = 10e-6
    node_bw: float | None = None
    hierarchical: bool = True

    def __post_init__(self) -> None:
        if self.node_bw is not None and not (
                isinstance(self.node_bw, (int, float)) and math.isfinite(self.node_bw)
                and self.node_bw > 0):
            raise ValueError(f"node_bw={self.node_bw!r} must be a positive number or None")
        for name in ("devices", "devices_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        for name in ("memory_gb", "flops", "efficiency", "intra_bw", "inter_bw"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name}={v!r} must be a positive number")
        for name in ("intra_latency", "inter_latency"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}={v!r} must be a non-negative number")

    def link(self, span: int) -> tuple[float, float]:
        """(alpha, beta) for a group whose ranks span ``span`` consecutive devices."""
        if span <= self.devices_per_node:
            return self.intra_latency, self.intra_bw
        return self.inter_latency, self.inter_bw

    @property
    def node_link_bw(self) -> float:
        """Bytes/s of one node's link (``node_bw``, or a port per device)."""
        return self.node_bw if self.node_bw is not None else self.devices_per_node * self.inter_bw


_RING = {"allreduce": allreduce_time, "reduce_scatter": reduce_scatter_time,
         "allgather": allgather_time}


def group_time(kind: str, nbytes: float, n: int, stride: int, cluster: Cluster) -> float:
    """Seconds of one ``kind`` collective of ``nbytes`` over a group of ``n`` ranks whose
    members are ``stride`` devices apart (mesh ranks: tp groups stride 1, dp groups stride
    tp), all groups of that kind running at once.

    A group inside one node takes the intra-node ring. One that spans nodes takes the
    two-level collective when ``cluster.hierarchical`` (see the module docstring), else a
    flat ring at the inter-node link.
    """
    ring = _RING[kind]
    if n <= 1:
        return 0.0
    span = (n - 1) * stride + 1
    dpn = cluster.devices_per_node
    if span <= dpn:
        return ring(nbytes, n, cluster.intra_latency, cluster.intra_bw)
    per_node = max(1, dpn // stride) if stride < dpn else 1
    if not cluster.hierarchical or per_node == 1 or n % per_node:
        return ring(nbytes, n, cluster.inter_latency, cluster.inter_bw)
    nodes = n // per_node
    factor = 2.0 if kind == "allreduce" else 1.0
    node_bytes = factor * (nodes - 1) / nodes * nbytes
    concurrent = min(stride, dpn)  # groups of this kind with ranks on the same node
    inter = max(concurrent * node_bytes / cluster.node_link_bw,
                node_bytes / per_node / cluster.inter_bw)
    inter += factor * (nodes - 1) * cluster.inter_latency
    intra = ring(nbytes, per_node, cluster.intra_latency, cluster.intra_bw)
    return max(inter, intra)


def _precision(precision: str) -> tuple[int, int, int, int, int]:
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ValueError(f"precision={precision!r} must be one of {sorted(PRECISIONS)}") \
            from None


def _moments(optimizer: str) -> int:
    try:
        return OPTIMIZER_MOMENTS[optimizer.lower()]
    except KeyError:
        raise ValueError(f"optimizer={optimizer!r} must be one of {sorted(OPTIMIZER_MOMENTS)}") \
            from None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest_multiple(x: float, step: int) -> int:
    return max(step, int(round(x / step)) * step)


def default_shape(params: float) -> tuple[int, int, int]:
    """(layers, hidden, heads) of a GPT with about ``params`` (= 12·L·h²) parameters when the
    user gives none: heads of size 128 and ``h ≈ 128·L`` (the usual aspect), with counts
    that divide well. The head count is a power of two below 8 and a multiple of 8 above
    (every tp of 1, 2, 4, 8 divides it), the layer count a multiple of 4 from 6 layers on
    (pipelines of 1, 2, 4 stages); 7.5B gives 36 layers, hidden 4096, 32 heads, 175B GPT-3's
    96 x 12288 with 96 heads. Pure."""
    if not (isinstance(params, (int, float)) and math.isfinite(params) and params > 0):
        raise ValueError(f"params={params!r} must be a positive number")
    aspect_layers = max(1.0, (params / (12 * 128 * 128)) ** (1 / 3))
    target_heads = math.sqrt(params / (12 * aspect_layers)) / 128
    if target_heads < 6:
        heads = 2 ** max(0, round(math.log2(max(target_heads, 1.0))))
    else:
        heads = _nearest_multiple(target_heads, 8)
    hidden = 128 * heads
    layers = max(1.0, params / (12 * hidden * hidden))
    n_layers = _nearest_multiple(layers, 4) if layers >= 6 else max(1, round(layers))
    return n_layers, hidden, heads


def resolve_shape(params: float, layers: int | None = None, hidden: int | None = None,
                  heads: int | None = None) -> tuple[int, int, int, tuple[str, ...]]:
    """``(layers, hidden, heads, defaulted)``: the shape given, completed from
    :func:`default_shape` (heads of size 128 for a given hidden size), and the names of
    the numbers that were not given. Pure."""
    d_layers, d_hidden, d_heads = default_shape(params)
    defaulted = tuple(n for n, v in (("layers", layers), ("hidden", hidden), ("heads", heads))
                      if v is None)
    layers = d_layers if layers is None else layers
    hidden = d_hidden if hidden is None else hidden
    if heads is None:
        heads = d_heads if hidden == d_hidden else max(1, hidden // 128)
    return layers, hidden, heads, defaulted


def shape_line(params: float, layers: int, hidden: int, heads: int, seq_len: int, *,
               defaulted: Sequence[str] = ()) -> str:
    """One line saying which transformer shape a plan assumes, and which of its numbers are
    the defaults for ``params``. Pure."""
    line = (f"model: {layers} layers, hidden {hidden}, {heads} heads (size "
            f"{hidden / heads:g}), sequence {seq_len}")
    if len(defaulted) == 3:
        line += (f": the default shape for {params:.3g} parameters (--layers, --hidden, "
                 "--heads change it)")
    elif defaulted:
        line += f" ({', '.join(f'--{n}' for n in defaulted)} from {params:.3g} parameters)"
    return line


def activation_bytes(*, layers: int, hidden: int, heads: int, seq_len: int, micro_batch: int,
                     tp: int, pp: int, micro_batches: int, act_bytes: int,
                     schedule: str = "1f1b", recompute: str = "none",
                     virtual_stages: int = 1) -> float:
    """Activation memory on the busiest device (the first pipeline stage): per layer
    Korthikanti et al.'s ``s b h (10 + 24/t + 5 a s/(h t))`` halves, or with recompute
    only the layer's input ``s b h``; times the micro-batches in flight
    (:func:`~mpidist.parallel.schedules.peak_in_flight`: GPipe all of them; 1F1B and
    zero-bubble at most ``pp``; interleaved counts chunks of ``layers / (pp v)`` layers on
    its orders, ``1 + (pp - 1) / (pp v)`` times 1F1B's for ``m`` a multiple of ``pp``)."""
    s, b, h, a = seq_len, micro_batch, hidden, heads
    if recompute == "blocks":
        per_layer = s * b * h * act_bytes
    else:
        per_layer = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)) * act_bytes / 2
    if pp == 1:
        return per_layer * layers
    v = virtual_stages
    return per_layer * (layers / (pp * v)) * peak_in_flight(schedule, pp, micro_batches, v)


def pipeline_compute_factor(schedule: str, recompute: str, pp: int, m: int,
                            virtual_stages: int = 1) -> float:
    """How much longer a step's compute takes than its work alone: the schedule's bubble
    (``step_units`` over the ``3m`` units of work; interleaved's divided by its virtual
    stages) and, with recompute, one more forward (4 units of work for 3). Pure."""
    factor = step_units(schedule, pp, m, virtual_stages) / (3 * m)
    return factor * (4 / 3 if recompute == "blocks" else 1.0)


def _plan_inputs(params: float, devices: int, optimizer: str, precision: str,
                 layers: int | None, hidden: int | None, heads: int | None, seq_len: int,
                 micro_batch: int, global_batch: int | None, cluster: Cluster | None,
                 zero_stages: Sequence[int], max_tp: int | None,
                 cluster_fields: dict[str, Any]) -> tuple[Any, ...]:
    """:func:`plan`'s arguments checked (a ValueError naming the bad value) and completed
    with their defaults."""
    if not (isinstance(params, (int, float)) and math.isfinite(params) and params > 0):
        raise ValueError(f"params={params!r} must be a positive number")
    if cluster is None:
        cluster = Cluster(devices=devices, **cluster_fields)
    elif cluster_fields:
        raise ValueError(f"give either cluster= or its fields, not both: {sorted(cluster_fields)}")
    if cluster.devices != devices:
        raise ValueError(f"devices={devices} differs from cluster.devices={cluster.devices}")
    p_bytes, g_bytes, _, _, act_bytes = _precision(precision)
    _moments(optimizer)
    layers, hidden, heads, _ = resolve_shape(params, layers, hidden, heads)
    for name, v in (("layers", layers), ("hidden", hidden), ("heads", heads),
                    ("seq_len", seq_len), ("micro_batch", micro_batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if global_batch is None:
        global_batch = devices * micro_batch
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r} must be a positive integer")
    for z in zero_stages:
        if z not in (0, 1, 2, 3):
            raise ValueError(f"zero stage {z!r} must be 0, 1, 2 or 3")
    max_tp = cluster.devices_per_node if max_tp is None else max_tp
    return (cluster, layers, hidden, heads, global_batch, max_tp, act_bytes, p_bytes,
            g_bytes)


def plan(params: float, devices: int, *, optimizer: str = "adam", precision: str = "mixed",
         layers: int | None = None, hidden: int | None = None, heads: int | None = None,
         seq_len: int = 2048, micro_batch: int = 1, global_batch: int | None = None,
         cluster: Cluster | None = None, zero_stages: Sequence[int] = (0, 1, 2, 3),
         max_tp: int | None = None, schedules: Sequence[str] = ("1f1b",),
         recompute: Sequence[str] = ("none",), virtual_stages: Sequence[int] = (2,),
         **cluster_fields: Any) -> list[dict[str, Any]]:
    """Every (pp, tp, dp, zero_stage) layout of ``devices`` for a model of ``params``
    parameters, with predicted memory and step time; layouts that fit first, fastest first.

    Args:
        params: number of parameters.
        devices: number of devices (the product pp·tp·dp).
        optimizer, precision: see :data:`OPTIMIZER_MOMENTS` and :data:`PRECISIONS`.
        layers, hidden, heads: the transformer's shape (defaults from ``params``).
        seq_len, micro_batch: tokens per sample and samples per micro-batch.
        global_batch: samples per step (default ``devices·micro_batch``); split over the dp
            indices as training splits it (slices one sample apart where it does not divide:
            the step is timed for the largest); a layout with fewer samples than dp indices
            is skipped.
        cluster: a :class:`Cluster`, or its fields as keyword arguments.
        max_tp: largest tensor-parallel size (default: devices per node).
        schedules, recompute: the pipeline schedules (where pp > 1) and activation
            checkpointing choices to plan with (see :func:`pipeline_compute_factor`).
        virtual_stages: the chunks per stage the interleaved schedule is planned with
            (layouts where ``layers`` does not divide into ``pp`` times them, or the
            micro-batches are not a multiple of ``pp``, are skipped for it).

    Rows carry ``pp, tp, dp, zero_stage, micro_batches, schedule, virtual_stages, recompute,
    params_per_device, model_state_gb, activation_gb, total_gb, compute_s, dp_comm_s,
    tp_comm_s, pp_comm_s, step_time_s, fits, copies_gb`` (the copies of in-job recovery in
    host memory, not in ``fits``; see the module doc).
    """
    cluster, layers, hidden, heads, global_batch, max_tp, act_bytes, p_bytes, g_bytes = \
        _plan_inputs(params, devices, optimizer, precision, layers, hidden, heads, seq_len,
                     micro_batch, global_batch, cluster, zero_stages, max_tp, cluster_fields)
    rows = []
    for pp in _divisors(devices):
        if layers % pp:
            continue
        for tp in _divisors(devices // pp):
            if tp > max_tp or heads % tp or hidden % tp:
                continue
            dp = devices // (pp * tp)
            if global_batch < dp:
                continue  # not a sample for every data-parallel index
            # An uneven split gives some dp indices one sample more: the step waits for them.
            local = -(-global_batch // dp)
            m = -(-local // micro_batch)
            psi = params / (pp * tp)
            act_args = {"layers": layers, "hidden": hidden, "heads": heads,
                        "seq_len": seq_len, "micro_batch": micro_batch, "tp": tp, "pp": pp,
                        "micro_batches": m, "act_bytes": act_bytes}
            work = 6 * params * (local * dp * seq_len) / (devices * cluster.flops
                                                           * cluster.efficiency)
            # tp varies fastest, then dp, then pp (ProcessMesh): a tp group spans tp
            # consecutive devices, a dp group tp·dp, a pipeline hop crosses tp·dp devices.
            act_msg = micro_batch * seq_len * hidden * act_bytes
            # Megatron: 2 allreduces forward, 2 backward per layer and micro-batch.
            tp_comm = 4 * (layers / pp) * m * group_time("allreduce", act_msg, tp, 1, cluster)
            a_pp, b_pp = cluster.link(tp * dp * 2 if pp > 1 else 1)
            pp_comm = 2 * m * (a_pp + act_msg / tp / b_pp) if pp > 1 else 0.0
            def sync(kind: str, nbytes: float, dp: int = dp, tp: int = tp) -> float:
                return group_time(kind, nbytes, dp, tp, cluster)

            for z in zero_stages:
                if (pp > 1 and z > 1) or (dp == 1 and z > 0):
                    # ZeRO-2/3 re-shard per micro-batch, which a pipeline multiplies; with
                    # dp=1 there is nothing to shard over.
                    continue
                states = psi * bytes_per_parameter(precision, optimizer, z, dp)
                g_all, p_all = psi * g_bytes, psi * p_bytes
                dp_comm = zero_sync_time(z, g_all, p_all, m, sync)
                copies = copies_bytes(psi, precision=precision, optimizer=optimizer,
                                      zero_stage=z, dp=dp, tp=tp, pp=pp) / GB
                for sched, v, rc in _pipeline_choices(pp, schedules, recompute,
                                                      virtual_stages):
                    if v > 1 and (layers % (pp * v) or m % pp):
                        continue  # the interleaved schedule cannot run this layout
                    act = activation_bytes(**act_args, schedule=sched, recompute=rc,
                                           virtual_stages=v)
                    compute = work * pipeline_compute_factor(sched, rc, pp, m, v)
                    rows.append(_row(
                        {"pp": pp, "tp": tp, "dp": dp, "zero_stage": z, "micro_batches": m,
                         "schedule": sched, "virtual_stages": v, "recompute": rc,
                         "params_per_device": psi, "copies_gb": copies},
                        states=states, act=act, compute=compute,
                        comm=(dp_comm, tp_comm, pp_comm * v), memory=cluster.memory_gb))
    rows.sort(key=lambda r: (not r["fits"], r["step_time_s"], r["total_gb"]))
    return rows


def _row(layout: dict[str, Any], *, states: float, act: float, compute: float,
         comm: tuple[float, float, float], memory: float) -> dict[str, Any]:
    """A plan row: the layout with its memory and times (``comm``: dp, tp and pp seconds;
    the pp's already counting an interleaved micro-batch's v times as many hops)."""
    total = states + act
    return {**layout, "model_state_gb": states / GB, "activation_gb": act / GB,
            "total_gb": total / GB, "compute_s": compute, "dp_comm_s": comm[0],
            "tp_comm_s": comm[1], "pp_comm_s": comm[2],
            "step_time_s": compute + sum(comm), "fits": total <= memory * GB}


def _pipeline_choices(pp: int, schedules: Sequence[str], recompute: Sequence[str],
                      virtual_stages: Sequence[int] = (2,)) -> list[tuple[str, int, str]]:
    """The (schedule, virtual stages, recompute) a layout is planned with; the schedule only
    matters where there is a pipeline, the virtual stages only for the interleaved one.
    ValueError naming a bad choice. Pure."""
    for sched in schedules:
        if sched not in SCHEDULES:
            raise ValueError(f"schedule {sched!r} is not one of {SCHEDULES}")
    for v in virtual_stages:
        if isinstance(v, bool) or not isinstance(v, int) or v < 2:
            raise ValueError(f"virtual stages {v!r} must be an integer >= 2 (the chunks per "
                             "stage of the interleaved schedule)")
    for rc in recompute:
        if rc not in ("none", "blocks"):
            raise ValueError(f"recompute {rc!r} is not one of ('none', 'blocks')")
    return [(sched, v, rc) for sched in (schedules if pp > 1 else ("1f1b",))
            for v in (virtual_stages if sched == "interleaved" else (1,)) for rc in recompute]


def zero_sync_time(stage: int, grad_bytes: float, param_bytes: float, micro_batches: int,
                   sync: Any) -> float:
    """Data-parallel communication of one step at ZeRO ``stage``; ``sync(kind, nbytes)``
    gives one collective's seconds. DDP: allreduce of the gradients; ZeRO-1: that and an
    allgather of the parameters; ZeRO-2: reduce-scatter and allgather; ZeRO-3:
    reduce-scatter and an allgather forward and backward per micro-batch."""
    if stage == 0:
        return sync("allreduce", grad_bytes)
    if stage == 1:
        return sync("allreduce", grad_bytes) + sync("allgather", param_bytes)
    if stage == 2:
        return sync("reduce_scatter", grad_bytes) + sync("allgather", param_bytes)
    return sync("reduce_scatter", grad_bytes) + 2 * micro_batches * sync("allgather", param_bytes)


def parse_count(text: str | float) -> float:
    """``"7.5B"``, ``"350M"``, ``"1.2e9"``, ``"2T"`` -> a number."""
    if isinstance(text, (int, float)):
        return float(text)
    s = str(text).strip().upper()
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    try:
        if s and s[-1] in mult:
            return float(s[:-1]) * mult[s[-1]]
        return float(s)
    except ValueError:
        raise ValueError(f"--params {text!r} is not a number (e.g. 7.5e9, 7.5B, 350M)") \
            from None


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register the ``plan`` subcommand on an ``add_subparsers()`` object."""
    p = sub.add_parser("plan", help="which (pp, tp, dp, zero) layouts fit, with memory and time",
                       description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--params", required=True, type=parse_count,
                   help="parameters, e.g. 7.5e9 or 7.5B")
    p.add_argument("--devices", required=True, type=int, help="number of devices")
    p.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZER_MOMENTS))
    p.add_argument("--precision", default="mixed", choices=sorted(PRECISIONS))
    p.add_argument("--layers", type=int, default=None,
                   help="transformer layers (default: from --params, a multiple of 4, so "
                        "that pipelines of 1, 2 and 4 stages divide them)")
    p.add_argument("--hidden", type=int, default=None,
                   help="hidden size (default: from --params, 128 x heads)")
    p.add_argument("--heads", type=int, default=None,
                   help="attention heads; tensor parallelism needs tp to divide them "
                        "(default: from --params, a multiple of 8; hidden / 128 for a given "
                        "--hidden)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sample (default: 2048)")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per micro-batch")
    p.add_argument("--global-batch", type=int, default=None, help="samples per step")
    p.add_argument("--zero-stages", default="0,1,2,3", help="comma-separated stages to consider")
    p.add_argument("--schedules", default="1f1b",
                   help="comma-separated pipeline schedules to consider (gpipe, 1f1b, "
                        "interleaved, zero-bubble; default: 1f1b)")
    p.add_argument("--virtual-stages", default="2",
                   help="comma-separated chunks per stage for --schedules interleaved "
                        "(default: 2)")
    p.add_argument("--recompute", default="none",
                   help="comma-separated activation checkpointing choices (none, blocks)")
    p.add_argument("--devices-per-node", type=int, default=8,
                   help="devices sharing the fast intra-node link (default: 8)")
    p.add_argument("--memory-gb", type=float, default=80.0, help="memory per device (1e9 B)")
    p.add_argument("--flops", type=float, default=312e12, help="peak FLOP/s per device")
    p.add_argument("--efficiency", type=float, default=0.5, help="achieved fraction of peak")
    p.add_argument("--intra-bw", type=float, default=150e9, help="intra-node bytes/s")
    p.add_argument("--intra-latency", type=float, default=5e-6, help="intra-node seconds")
    p.add_argument("--inter-bw", type=float, default=25e9, help="inter-node bytes/s")
    p.add_argument("--inter-latency", type=float, default=10e-6, help="inter-node seconds")
    p.add_argument("--node-bw", type=float, default=None,
                   help="bytes/s of a node's link, shared by its devices (default: "
                        "devices-per-node x inter-bw)")
    p.add_argument("--flat-collectives", action="store_true",
                   help="model flat rings across nodes instead of two-level collectives")
    p.add_argument("--all", action="store_true", help="also list layouts that do not fit")
    p.add_argument("--top", type=int, default=20, help="rows to print (table output)")
    p.add_argument("--json", action="store_true", help="JSON rows on stdout")
    p.set_defaults(func=run)
    return p


def _ints(text: str, flag: str, example: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in str(text).split(",") if s.strip())
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be like {example}") from None


def run(args: argparse.Namespace) -> int:
    """Run ``mpidist plan`` from parsed arguments; prints a table or JSON. Returns 0."""
    stages = _ints(args.zero_stages, "--zero-stages", "0,1,2,3")
    cluster = Cluster(devices=args.devices, devices_per_node=args.devices_per_node,
                      memory_gb=args.memory_gb, flops=args.flops, efficiency=args.efficiency,
                      intra_bw=args.intra_bw, intra_latency=args.intra_latency,
                      inter_bw=args.inter_bw, inter_latency=args.inter_latency,
                      node_bw=args.node_bw, hierarchical=not args.flat_collectives)
    rows = plan(args.params, args.devices, optimizer=args.optimizer, precision=args.precision,
                layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq_len,
                micro_batch=args.micro_batch, global_batch=args.global_batch, cluster=cluster,
                zero_stages=stages,
                schedules=tuple(x.strip() for x in args.schedules.split(",") if x.strip()),
                recompute=tuple(x.strip() for x in args.recompute.split(",") if x.strip()),
                virtual_stages=_ints(args.virtual_stages, "--virtual-stages", "2,4"))
    if not args.all:
        shown = [r for r in rows if r["fits"]]
    else:
        shown = rows
    layers, hidden, heads, defaulted = resolve_shape(args.params, args.layers, args.hidden,
                                                     args.heads)
    if args.json:
        model = {"layers": layers, "hidden": hidden, "heads": heads, "seq_len": args.seq_len,
                 "defaulted": list(defaulted)}
        print(json.dumps({"cluster": asdict(cluster), "params": args.params,
                          "precision": args.precision, "optimizer": args.optimizer,
                          "model": model, "rows": shown}, indent=1))
        return 0
    print(shape_line(args.params, layers, hidden, heads, args.seq_len, defaulted=defaulted))
    print(f"{args.params:.3g} parameters on {args.devices} devices ({args.precision}, "
          f"{args.optimizer}); {sum(r['fits'] for r in rows)} of {len(rows)} layouts fit in "
          f"{args.memory_gb:g} GB")
    print(f"{'pp':>3} {'tp':>3} {'dp':>5} {'zero':>4} {'states GB':>10} {'act GB':>8} "
          f"{'total GB':>9} {'step s':>9} {'comm s':>8}  fits  schedule        recompute"
          "  copies GB (host)")
    for r in shown[:args.top]:
        comm = r["dp_comm_s"] + r["tp_comm_s"] + r["pp_comm_s"]
        print(f"{r['pp']:>3} {r['tp']:>3} {r['dp']:>5} {r['zero_stage']:>4} "
              f"{r['model_state_gb']:>10.2f} {r['activation_gb']:>8.2f} {r['total_gb']:>9.2f} "
              f"{r['step_time_s']:>9.3f} {comm:>8.3f}  {'yes' if r['fits'] else 'no':<4}  "
              f"{_schedule_cell(r):<14}  {r['recompute']:<9}  {r['copies_gb']:>9.2f}")
    if not shown:
        print("no layout fits; try more devices, ZeRO-3, a smaller micro-batch, or --all")
    return 0


def _schedule_cell(row: dict[str, Any]) -> str:
    if row["pp"] == 1:
        return "-"
    v = row["virtual_stages"]
    return row["schedule"] + (f" v={v}" if v > 1 else "")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mpidist.parallel.plan ...``: the ``plan`` subcommand on its own."""
    parser = argparse.ArgumentParser(prog="mpidist")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
