"""``fully_shard`` over MPI in the style of torch's FSDP2 (ZeRO-3); docs/torch.md has the
user's view.

Each call makes one *unit* of the parameters of its module that no inner unit holds. Every
parameter is kept as this rank's rows of dimension 0 (``torch.chunk``, as FSDP2's
``Shard(0)``), a plain ``nn.Parameter``; the shards of a unit are views of one flat segment
that the unit's all-gather sends without a copy. Before a unit's forward and again before
its backward its full parameters are gathered into one flat tensor whose storage is freed
afterwards (``untyped_storage().resize_(0)``; autograd's saved tensors keep pointing at it,
and the regather does not bump their version counters). When a unit's gradients are all
accumulated they are divided by the world size and reduce-scattered into the shards. At the
end of backward (an autograd final callback) one small allreduce tells which parameters got
a gradient on any rank (the others keep ``grad=None``) and the shards' ``.grad`` are set, or
added to (accumulation).
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from mpidist.core import collectives as C
from mpidist.core.buffers import row_range, shard_size
from mpidist.optim.clipping import clip_coefficient
from mpidist.torch._common import (
    REDUCIBLE,
    HostView,
    agree,
    broadcast_tensors,
    overlap,
    resolve_comm,
)

__all__ = ["FSDPModule", "ShardInfo", "fully_shard", "gathered_bytes"]


@dataclass(frozen=True)
class ShardInfo:
    """Where a sharded parameter's rows sit in the global tensor (``param._mpidist_shard``)."""

    shape: tuple[int, ...]  # global shape
    lo: int                 # this rank's rows [lo, hi) of dimension 0 (0-d: one "row")
    hi: int
    comm: Any

    @property
    def flat(self) -> slice:
        """This rank's elements of the C-order flattened global tensor."""
        row = math.prod(self.shape[1:])
        return slice(self.lo * row, self.hi * row)


class _Param:
    """One managed parameter: its shard, its unsharded view and where the module holds it."""

    def __init__(self, name: str, p: torch.nn.Parameter, n: int) -> None:
        self.name = name
        self.shape = tuple(p.shape)
        self.rows = self.shape[0] if self.shape else 1
        self.row = math.prod(self.shape[1:])
        self.seg = shard_size(self.rows, n) * self.row  # elements per rank in the segment
        self.numel = p.numel()
        self.requires_grad = p.requires_grad
        self.locations: list[tuple[torch.nn.Module, str]] = []
        self.shard: torch.nn.Parameter = p       # replaced when the unit is built
        self.full: torch.nn.Parameter = p
        self.off = 0                              # offset in the unit's segment
        self.full_off = 0                         # offset in the unit's full flat tensor


class _Unit:
    """The state of one ``fully_shard`` call: its parameters and communication buffers."""

    def __init__(self, params: list[_Param], comm: Any, reshard_after_forward: bool) -> None:
        self.params = params
        self.comm = comm
        self.size = comm.Get_size()
        self.reshard_after_forward = reshard_after_forward
        self.requires_gradient_sync = True
        first = params[0].shard if params else torch.empty(0)
        self.dtype, self.device = first.dtype, first.device
        off = full_off = 0
        for p in params:
            p.off, p.full_off = off, full_off
            off += p.seg
            full_off += p.numel
        self.seg_numel, self.full_numel = off, full_off
        self.segment = torch.zeros(self.seg_numel, dtype=self.dtype, device=self.device)
        self.full_flat = torch.zeros(self.full_numel, dtype=self.dtype, device=self.device)
        self.ctx: _Context | None = None
        self.gathered = True       # the module holds the full parameters
        self.gather: tuple[Any, torch.Tensor, HostView] | None = None  # in flight
        self.reduce: tuple[Any, torch.Tensor, HostView, Any] | None = None
        self.grads_ready = 0
        self.n_trainable = sum(p.requires_grad for p in params)
        self.pre_backward_done = False
        self.got_grad: dict[_Param, bool] = {}

    # -- storage ---------------------------------------------------------------------------
    def _count(self, nbytes: int) -> None:
        """Account for gathered parameter bytes (full tensors and gathers in flight)."""
        if self.ctx is not None:
            self.ctx.alive += nbytes
            self.ctx.peak = max(self.ctx.peak, self.ctx.alive)

    @property
    def full_bytes(self) -> int:
        return self.full_numel * self.full_flat.element_size()

    def _alloc(self) -> None:
        storage = self.full_flat.untyped_storage()
        if storage.nbytes() != self.full_bytes:
            storage.resize_(self.full_bytes)
            self._count(self.full_bytes)

    def free(self) -> None:
        """Drop the full parameters (the shards stay); not collective."""
        storage = self.full_flat.untyped_storage()
        if storage.nbytes():
            self._count(-storage.nbytes())
            storage.resize_(0)
        self._swap(full=False)

    def _swap(self, full: bool) -> None:
        for p in self.params:
            t = p.full if full else p.shard
            for mod, attr in p.locations:
                mod._parameters[attr] = t
        self.gathered = full

    # -- all-gather ------------------------------------------------------------------------
    def start_gather(self, blocking: bool = False) -> None:
        """Start (``blocking``: run) the all-gather of the full parameters, unless they are
        there or on their way (collective over the unit's comm)."""
        if self.gather is not None or self.full_flat.untyped_storage().nbytes():
            return
        recv = torch.empty(self.size * self.seg_numel, dtype=self.dtype, device=self.device)
        self._count(recv.numel() * recv.element_size())
        send, out = HostView(self.segment).to_host(), HostView(recv)
        if blocking:
            C.allgather(send, comm=self.comm, out=out.to_host())
            self.gather = (None, recv, out)
        else:
            self.gather = (C.iallgather(send, comm=self.comm, out=out.to_host()), recv, out)

    def unshard(self) -> None:
        """Make the full parameters available: wait for the prefetched all-gather, or run a
        blocking one (faster in MPI than a nonblocking one that nothing overlaps)."""
        if self.full_flat.untyped_storage().nbytes() and self.gather is None:
            self._swap(full=True)
            return
        self.start_gather(blocking=True)
        req, recv, out = self.gather
        self.gather = None
        if req is not None:
            req.wait()
        out.to_device()
        self._alloc()
        table = recv.view(self.size, self.seg_numel)
        with torch.no_grad():
            for p in self.params:
                with torch.autograd._unsafe_preserve_version_counter(p.full):
                    _copy_chunks(table, p, p.full.view(-1), out=True)
        self._count(-recv.numel() * recv.element_size())
        del recv
        self._swap(full=True)

    # -- reduce-scatter --------------------------------------------------------------------
    def start_reduce(self, blocking: bool = False) -> None:
        """Divide the full gradients by the world size and start their reduce-scatter into
        a new segment (collective over the unit's comm; ``blocking``: run it now); free the
        full gradients."""
        send = torch.zeros(self.size * self.seg_numel, dtype=self.dtype, device=self.device)
        table = send.view(self.size, self.seg_numel)
        for p in self.params:
            g = p.full.grad
            self.got_grad[p] = g is not None
            if g is not None:
                _copy_chunks(table, p, g.reshape(-1), out=False)
                p.full.grad = None
        if self.size > 1:
            send.div_(self.size)
        recv = torch.empty(self.seg_numel, dtype=self.dtype, device=self.device)
        send_v, recv_v = HostView(send), HostView(recv)
        if blocking:
            C.reduce_scatter(send_v.to_host(), "sum", comm=self.comm, out=recv_v.to_host())
            recv_v.to_device()
            self.reduce = (None, recv, recv_v, None)
        else:  # the send buffer lives until the wait
            req = C.ireduce_scatter(send_v.to_host(), "sum", comm=self.comm,
                                    out=recv_v.to_host())
            self.reduce = (req, recv, recv_v, send_v)

    def wait_reduce(self) -> None:
        """Complete the reduce-scatter in flight and drop its send buffer."""
        if self.reduce is not None and self.reduce[0] is not None:
            req, recv, recv_v, _ = self.reduce
            req.wait()
            recv_v.to_device()
            self.reduce = (None, recv, recv_v, None)

    def finish_reduce(self, anywhere: dict[_Param, bool]) -> None:
        """Wait for the reduce-scatter and set (or add to) the shards' gradients."""
        if self.reduce is None:
            return
        self.wait_reduce()
        recv = self.reduce[1]
        self.reduce = None
        for p in self.params:
            if anywhere[p]:
                g = recv[p.off:p.off + p.shard.numel()].view(p.shard.shape)
                if p.shard.grad is None:
                    p.shard.grad = g
                else:
                    p.shard.grad += g


def _copy_chunks(table: torch.Tensor, p: _Param, flat: torch.Tensor, *, out: bool) -> None:
    """Copy between a parameter's C-order elements ``flat`` and its column block of the
    rank-major ``table`` (``[rank, segment]``): ``out`` copies table -> flat."""
    if p.numel == 0:
        return
    block = table[:, p.off:p.off + p.seg]
    whole = p.numel // p.seg  # ranks holding a full chunk
    rest = p.numel - whole * p.seg
    pairs = [(block[:whole], flat[:whole * p.seg].view(whole, p.seg))]
    if rest:
        pairs.append((block[whole, :rest], flat[whole * p.seg:]))
    for t, f in pairs:
        if out:
            f.copy_(t)
        else:
            t.copy_(f)


class _Context:
    """State shared by the units of one model: forward order, backward bookkeeping."""

    def __init__(self, root: _Unit) -> None:
        self.root = root
        self.order: list[_Unit] = []
        self.recording = True
        self.overlap = overlap()      # prefetch gathers, reduce-scatters in flight
        self.in_backward = False
        self.alive = 0                # bytes of full parameters allocated now
        self.peak = 0
        self.reduced: list[_Unit] = []

    def position(self, unit: _Unit) -> int:
        return next((i for i, u in enumerate(self.order) if u is unit), -1)


_CURRENT: list[_Context] = []  # the context whose root forward is running


class FSDPModule:
    """Mixin of the modules ``fully_shard`` was applied to (torch FSDP2's names)."""

    _mpidist_unit: _Unit

    def unshard(self) -> None:
        """All-gather this unit's full parameters now. Collective over the unit's comm."""
        self._mpidist_unit.unshard()

    def reshard(self) -> None:
        """Free this unit's full parameters. Not collective."""
        self._mpidist_unit.free()

    def set_reshard_after_forward(self, reshard_after_forward: bool) -> None:
        """Whether this unit frees its full parameters after forward. Not collective."""
        self._mpidist_unit.reshard_after_forward = bool(reshard_after_forward)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """With False, backward keeps full gradients locally (accumulating) and makes no MPI
        call; the next backward with True reduce-scatters the sum. Not collective."""
        mods = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        for m in mods:
            if isinstance(m, FSDPModule):
                m._mpidist_unit.requires_gradient_sync = bool(requires_gradient_sync)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the sharded gradients by their global norm (one allreduce of a scalar);
        returns the total norm. Collective over the root's comm."""
        return clip_grad_norm_(self, max_norm, norm_type)  # type: ignore[arg-type]


def fully_shard(module: torch.nn.Module, *, comm: Any = None, mesh: Any = None,
                reshard_after_forward: bool = True) -> torch.nn.Module:
    """Shard ``module``'s parameters (those no inner ``fully_shard`` holds) over ``comm``.

    Collective over ``comm`` (default: every rank): the unit's parameter names, shapes,
    dtypes and devices must agree between ranks (else the same ``ValueError`` on every
    rank); the values are taken from rank 0. Returns ``module`` itself, whose class now also
    derives from :class:`FSDPModule`. Apply it to the blocks first, then to the root; build
    the optimizer afterwards, over ``model.parameters()`` (the shards). A parameter tied to
    one in another unit is an error: put both in one unit.

    Superseded by torch's own ``fully_shard`` on the "mpidist" backend (docs/torch.md); this
    one warns (FutureWarning) and stays for existing scripts.
    """
    warnings.warn(
        "mpidist.torch.fully_shard is superseded by torch.distributed.fsdp.fully_shard on the "
        "'mpidist' backend (import mpidist.torch; torch.distributed.init_process_group("
        "'mpidist')): its DTensor parameters give torch's clip_grad_norm_ the global norm "
        "(with this one it is each rank's own) and full state dicts",
        FutureWarning, stacklevel=2)
    comm = resolve_comm(comm, mesh)
    size = comm.Get_size()
    error, params = _collect(module, size)
    items = [f"{p.name} {p.shape} {p.shard.dtype} {p.shard.device.type} {p.requires_grad}"
             for p in params] + [f"reshard_after_forward={reshard_after_forward}"]
    agree(comm, f"fully_shard({type(module).__name__})", error, items)
    broadcast_tensors([p.shard.detach() for p in params] + list(module.buffers()), comm)
    unit = _Unit(params, comm, bool(reshard_after_forward))
    rank = comm.Get_rank()
    for p in params:
        lo, hi = row_range(p.rows, rank, size)
        info = ShardInfo(p.shape, lo, hi, comm)
        view = unit.segment[p.off:p.off + (hi - lo) * p.row]
        with torch.no_grad():
            view.copy_(p.shard.detach().reshape(-1)[info.flat])
        shard = torch.nn.Parameter(view.view(hi - lo, *p.shape[1:]),
                                   requires_grad=p.requires_grad)
        shard._mpidist_shard = info  # type: ignore[attr-defined]
        _SHARDED_ORIGINALS[id(p.shard)] = (weakref.ref(p.shard), p.name)
        full = torch.nn.Parameter(unit.full_flat[p.full_off:p.full_off + p.numel].view(p.shape),
                                  requires_grad=p.requires_grad)
        p.shard, p.full = shard, full
        if p.requires_grad:
            full.register_post_accumulate_grad_hook(_grad_hook(unit))
    unit.free()
    cls = type(module)
    module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module._mpidist_unit = unit  # type: ignore[assignment]
    module._mpidist_wrapped = "fully_shard"  # type: ignore[assignment]
    module.register_forward_pre_hook(_pre_forward, prepend=True)
    module.register_forward_hook(_post_forward, always_call=False)
    return module


# id of a parameter replaced by shards -> (weak reference to it, its name): a later unit
# that still finds it in its module has a parameter tied across units.
_SHARDED_ORIGINALS: dict[int, tuple[weakref.ref, str]] = {}


def _collect(module: torch.nn.Module, size: int) -> tuple[str | None, list[_Param]]:
    """This unit's parameters (skipping inner units' shards) and a local error, if any."""
    if isinstance(module, FSDPModule):
        return "fully_shard was already applied to this module", []
    wrapped = getattr(module, "_mpidist_wrapped", None)
    if wrapped:
        return f"the module is already wrapped by {wrapped}", []
    found: dict[int, _Param] = {}
    error = None
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in list(mod._parameters.items()):
            if p is None or hasattr(p, "_mpidist_shard"):
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            ref, other = _SHARDED_ORIGINALS.get(id(p), (None, ""))
            if ref is not None and ref() is p and error is None:
                error = (f"parameter {name!r} is tied to {other!r}, which "
                         "an inner fully_shard unit holds; apply fully_shard to a module that "
                         "contains both")
            entry = found.get(id(p))
            if entry is None:
                entry = found[id(p)] = _Param(name, p, size)
            if (mod, attr) not in entry.locations:
                entry.locations.append((mod, attr))
    params = list(found.values())
    kinds = {(p.shard.dtype, p.shard.device) for p in params}
    if len(kinds) > 1 and error is None:
        error = (f"the unit's parameters have several dtypes/devices {sorted(map(str, kinds))}; "
                 "fully_shard needs one per unit")
    if params and params[0].shard.dtype not in REDUCIBLE and error is None:
        error = f"dtype {params[0].shard.dtype}: fully_shard reduces float32 and float64"
    return error, params


# -- hooks ----------------------------------------------------------------------------------
def _pre_forward(module: torch.nn.Module, args: Any) -> None:
    unit: _Unit = module._mpidist_unit  # type: ignore[assignment]
    if _CURRENT and _CURRENT[-1].root is unit:  # a forward that raised left it set
        _CURRENT.clear()
    if not _CURRENT:  # the outermost unit: the root of this model
        if unit.ctx is None or unit.ctx.root is not unit:
            unit.ctx = _Context(unit)
        ctx = unit.ctx
        if ctx.in_backward:  # a backward that raised never reached its final callback
            ctx.in_backward, ctx.reduced = False, []
        _CURRENT.append(ctx)
    ctx = _CURRENT[-1]
    unit.ctx = ctx
    pos = ctx.position(unit)
    if pos < 0:
        pos = len(ctx.order)
        ctx.order.append(unit)
    unit.unshard()
    unit.pre_backward_done = False
    if ctx.overlap and not ctx.recording and 0 <= pos < len(ctx.order) - 1:
        ctx.order[pos + 1].start_gather()


def _post_forward(module: torch.nn.Module, args: Any, output: Any) -> Any:
    unit: _Unit = module._mpidist_unit  # type: ignore[assignment]
    ctx: _Context = unit.ctx  # type: ignore[assignment]  # set by _pre_forward
    if torch.is_grad_enabled():
        for t in tree_flatten(output)[0]:
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(_pre_backward_hook(unit))
    if unit is ctx.root:
        ctx.recording = False
        _CURRENT.clear()
    if not torch.is_grad_enabled() or (unit.reshard_after_forward and unit is not ctx.root):
        unit.free()  # no backward follows a forward without gradients
    return output


def _pre_backward_hook(unit: _Unit) -> Any:
    def hook(grad: torch.Tensor) -> None:
        if unit.pre_backward_done:
            return
        unit.pre_backward_done = True
        ctx: _Context = unit.ctx  # type: ignore[assignment]  # set in forward
        if not ctx.in_backward:
            ctx.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _finish(ctx))
        unit.unshard()
        unit.grads_ready = 0
        pos = ctx.position(unit)
        if ctx.overlap and pos > 1:  # the root (position 0) stays gathered after forward
            ctx.order[pos - 1].start_gather()
    return hook


def _grad_hook(unit: _Unit) -> Any:
    def hook(p: torch.Tensor) -> None:
        unit.grads_ready += 1
        ctx = unit.ctx
        if unit.grads_ready == unit.n_trainable and ctx is not None and ctx.in_backward:
            _reduce(unit, ctx)
    return hook


def _reduce(unit: _Unit, ctx: _Context, blocking: bool = False) -> None:
    if unit.requires_gradient_sync:
        for earlier in ctx.reduced:  # one reduce-scatter in flight: bounded send buffers
            earlier.wait_reduce()
        # The root's gradients are complete only at the end of backward: nothing to overlap.
        unit.start_reduce(blocking=blocking or unit is ctx.root or not ctx.overlap)
        ctx.reduced.append(unit)
    unit.free()


def _finish(ctx: _Context) -> None:
    """End of backward: reduce what is left, wait, agree on which got gradients."""
    try:
        for unit in reversed(ctx.order):
            if unit not in ctx.reduced and unit.pre_backward_done and unit.gathered:
                _reduce(unit, ctx, blocking=True)
            elif unit.gathered:  # the root (last here) stayed gathered after forward
                unit.free()
        synced = [u for u in ctx.order if u in ctx.reduced]
        flags = torch.tensor([u.got_grad.get(p, False) for u in synced for p in u.params],
                             dtype=torch.int32)
        if flags.numel() and ctx.root.comm.Get_size() > 1:
            C.allreduce(flags.numpy(), "max", comm=ctx.root.comm)
        got = iter(flags.tolist())
        for u in synced:
            u.finish_reduce({p: bool(next(got)) for p in u.params})
    finally:
        ctx.reduced = []
        ctx.in_backward = False
        for u in ctx.order:
            u.pre_backward_done = False
            u.got_grad = {}


# -- utilities ------------------------------------------------------------------------------
def gathered_bytes(module: torch.nn.Module) -> dict[str, int]:
    """Bytes of gathered parameters (full tensors and all-gathers in flight) allocated now
    (``alive``) and at most since the last call (``peak``), with the largest unit's and the
    root unit's full bytes, for a model built with :func:`fully_shard`. Resets the peak.
    Not collective."""
    unit: _Unit = module._mpidist_unit  # type: ignore[assignment]
    ctx = unit.ctx
    if ctx is None:
        return {"alive": 0, "peak": 0, "largest_unit": unit.full_bytes, "root_unit": 0}
    out = {"alive": ctx.alive, "peak": ctx.peak, "root_unit": ctx.root.full_bytes,
           "largest_unit": max((u.full_bytes for u in ctx.order), default=0)}
    ctx.peak = ctx.alive
    return out


def clip_grad_norm_(module: torch.nn.Module, max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a sharded model by their global norm; returns the norm.

    Collective over the comm of ``module``'s unit: each rank sums its shards' contributions,
    one allreduce makes the total, and every shard's gradient is scaled as
    ``torch.nn.utils.clip_grad_norm_`` would scale the full gradients.
    """
    unit: _Unit = module._mpidist_unit  # type: ignore[assignment]
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    inf = math.isinf(norm_type)
    if inf:
        local = float(torch.stack([g.detach().abs().max() for g in grads]).max())
    else:
        local = sum(float(g.detach().double().abs().pow(norm_type).sum()) for g in grads)
    total = torch.tensor([local], dtype=torch.float64)
    C.allreduce(total.numpy(), "max" if inf else "sum", comm=unit.comm)
    norm = total[0] if inf else total[0] ** (1.0 / norm_type)
    coef = clip_coefficient(max_norm, float(norm))
    if coef < 1.0:
        for g in grads:
            g.detach().mul_(coef)
    return norm.to(grads[0].dtype)
