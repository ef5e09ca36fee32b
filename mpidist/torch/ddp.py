"""``DistributedDataParallel`` over MPI, with torch's interface and semantics.

During backward a post-accumulate-grad hook copies each gradient, divided by the world size,
into its bucket (a flat tensor; buckets in reverse registration order, the first one small)
and makes ``param.grad`` a view of its slot. A full bucket is summed over the ranks at once
(with ``MPIDIST_TORCH_OVERLAP=1`` by a nonblocking allreduce that the later hooks progress;
buckets start in index order on every rank). An autograd final callback waits for them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from mpidist.core import collectives as C
from mpidist.core.buffers import TensorSpec, make_buckets
from mpidist.torch._common import (
    HostView,
    agree,
    broadcast_tensors,
    module_fingerprint,
    overlap,
    resolve_comm,
)

__all__ = ["DistributedDataParallel"]

_FIRST_BUCKET_BYTES = 1 << 20  # as torch: the first bucket (the last layers) starts early


class _Bucket:
    """A flat gradient tensor for a run of parameters and its allreduce in flight."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        sizes = [p.numel() for p in params]
        self.flat = torch.zeros(sum(sizes), dtype=params[0].dtype, device=params[0].device)
        self.slots = [s.view_as(p) for s, p in zip(self.flat.split(sizes), params, strict=True)]
        self.view = HostView(self.flat)
        self.pending = len(params)
        self.request: C.Request | None = None

    def reset(self) -> None:
        self.pending = len(self.params)
        self.request = None


class DistributedDataParallel(torch.nn.Module):
    """Data parallelism for a torch module over MPI, with torch's DDP interface.

    Collective construction over ``comm`` (default: every rank): the module's parameter and
    buffer names, shapes, dtypes and devices are checked to agree between ranks (one small
    allgather; a difference raises the same ``ValueError`` on every rank, naming it), then
    parameters and buffers are broadcast from rank 0.

    Training is torch's: ``out = ddp(x)`` (any output structure), the user computes the loss,
    ``loss.backward()`` leaves the gradients averaged over the ranks, and any torch optimizer
    steps ``ddp.parameters()``. ``no_sync()`` accumulates gradients locally; buffers (e.g.
    BatchNorm statistics) are broadcast from rank 0 before each forward when
    ``broadcast_buffers``. Every forward/backward is collective over ``comm``.

    Args:
        module: the model (CPU or one CUDA device; float32/float64 trainable parameters).
        device_ids, output_device, dim: accepted for torch compatibility; ``device_ids``
            must name the module's device if given.
        comm: an mpi4py intracommunicator (``process_group=`` is accepted as an alias).
        broadcast_buffers: broadcast buffers from rank 0 before every forward.
        bucket_cap_mb: bucket size in MiB (torch's default 25; the first bucket is 1 MiB).
        find_unused_parameters: parameters that get no gradient in a backward are treated as
            zero on that rank (one extra small allreduce per backward decides which got a
            gradient anywhere; those that got none keep their ``.grad``). When False, such
            parameters raise a ``RuntimeError`` naming them at the end of backward.
        gradient_as_bucket_view, static_graph: accepted for compatibility (gradients are
            always views of the buckets after a synchronised backward).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: list[Any] | None = None,
        output_device: Any = None,
        dim: int = 0,
        *,
        comm: Any = None,
        process_group: Any = None,
        broadcast_buffers: bool = True,
        bucket_cap_mb: float | None = 25.0,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        comm = resolve_comm(comm, process_group)
        items, error = module_fingerprint(module, [f"bucket_cap_mb={bucket_cap_mb}",
                                                   f"find_unused={find_unused_parameters}"])
        if error is None:
            error = _wrap_error(module, device_ids, bucket_cap_mb)
        agree(comm, "DistributedDataParallel", error, items)
        del output_device, dim, gradient_as_bucket_view, static_graph
        self.module = module
        self.comm = comm
        self.broadcast_buffers = bool(broadcast_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        module._mpidist_wrapped = "DistributedDataParallel"  # type: ignore[assignment]
        broadcast_tensors([p.detach() for p in module.parameters()]
                          + [b for b in module.buffers()], comm)
        cap = int((25.0 if bucket_cap_mb is None else bucket_cap_mb) * (1 << 20))
        self._names = {p: n for n, p in module.named_parameters()}
        self._buckets = _make_buckets([p for p in module.parameters() if p.requires_grad], cap)
        self._where = {p: (b, slot) for b in self._buckets
                       for p, slot in zip(b.params, b.slots, strict=True)}
        self._ready: set[torch.nn.Parameter] = set()
        self._next = 0  # next bucket to start (buckets start in index order everywhere)
        self._sync_backward = False
        self._overlap = overlap()
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                       for p in self._where]

    # -- torch's interface ------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module. Collective when buffers are broadcast (``broadcast_buffers``)."""
        if self.broadcast_buffers and self.require_forward_param_sync:
            broadcast_tensors(list(self.module.buffers()), self.comm)
        if torch.is_grad_enabled():
            self._sync_backward = self.require_backward_grad_sync
        out = self.module(*inputs, **kwargs)
        # As torch: the forward after one without gradient sync skips the buffer broadcast.
        self.require_forward_param_sync = torch.is_grad_enabled() and \
            self.require_backward_grad_sync
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this context, backward accumulates gradients locally without any MPI call;
        the first backward after it synchronises the accumulated gradients. Not collective."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # -- backward -----------------------------------------------------------------------------
    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync_backward or p.grad is None:
            return
        if not self._ready:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        if p in self._ready:
            raise RuntimeError(
                f"parameter {self._names[p]!r} got a gradient twice in one synchronised "
                "backward; use no_sync() for the backwards before the last"
            )
        bucket, slot = self._where[p]
        self._into_slot(p, slot)
        self._ready.add(p)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._start_ready()
        else:
            self._progress()

    def _start_ready(self, final: bool = False) -> None:
        """Start the ready buckets in index order. The last bucket is only ready when
        backward is over: it is reduced at the end (``final``) with a blocking allreduce,
        which MPI runs faster than a nonblocking one that nothing overlaps."""
        n = self.comm.Get_size()
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            bucket = self._buckets[self._next]
            last = self._next == len(self._buckets) - 1
            if last and not final:
                return
            # The slots hold gradient / n (as torch: divide first, then sum).
            if n > 1 and (last or not self._overlap):
                C.allreduce(bucket.view.to_host(), "sum", comm=self.comm)
                bucket.view.to_device()
            elif n > 1:
                bucket.request = C.iallreduce(bucket.view.to_host(), "sum", comm=self.comm)
            self._next += 1

    def _into_slot(self, p: torch.Tensor, slot: torch.Tensor) -> None:
        """Put ``p.grad / world size`` into its bucket slot (one pass) and make ``p.grad``
        a view of the slot."""
        n = self.comm.Get_size()
        if p.grad.data_ptr() == slot.data_ptr():  # accumulated in place since last sync
            if n > 1:
                slot.div_(n)
        elif n > 1:
            torch.div(p.grad, n, out=slot)
        else:
            slot.copy_(p.grad)
        p.grad = slot

    def _progress(self) -> None:
        for bucket in self._buckets[:self._next]:
            if bucket.request is not None and not bucket.request.done:
                bucket.request.test()
                return

    def _finish(self) -> None:
        """End of a synchronised backward: start what is left, wait for every bucket."""
        missing = [p for p in self._where if p not in self._ready]
        try:
            if missing and not self.find_unused_parameters:
                self._wait()
                names = [self._names[p] for p in missing]
                raise RuntimeError(
                    f"parameters {names} received no gradient in this backward; pass "
                    "find_unused_parameters=True to DistributedDataParallel if parts of the "
                    "model are unused"
                )
            unused: set[torch.Tensor] = set()
            for p in missing:
                bucket, slot = self._where[p]
                if p.grad is None:  # no gradient on this rank: zero contribution
                    slot.zero_()
                    unused.add(p)
                else:  # accumulated under no_sync() but unused in this backward
                    self._into_slot(p, slot)
                bucket.pending -= 1
            self._start_ready(final=True)
            flags = torch.tensor([p not in unused for p in self._where], dtype=torch.int32)
            used = None
            if self.find_unused_parameters and self.comm.Get_size() > 1:
                used = C.iallreduce(flags.numpy(), "max", comm=self.comm)
            self._wait()
            anywhere = used.wait() if used is not None else flags.numpy()
            for p, flag in zip(self._where, anywhere, strict=True):
                if p in unused and flag:  # used on another rank: take the average
                    p.grad = self._where[p][1]
        finally:
            self._ready.clear()
            self._next = 0
            self._sync_backward = False
            for bucket in self._buckets:
                bucket.reset()

    def _wait(self) -> None:
        for bucket in self._buckets:
            if bucket.request is not None:
                bucket.request.wait()
                bucket.view.to_device()


def _wrap_error(module: torch.nn.Module, device_ids: Any, bucket_cap_mb: Any) -> str | None:
    """A local reason not to wrap ``module``, or None."""
    if isinstance(module, DistributedDataParallel) or getattr(module, "_mpidist_wrapped", None):
        kind = getattr(module, "_mpidist_wrapped", "DistributedDataParallel")
        return f"the module is already wrapped by {kind}; wrap it once"
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        return f"bucket_cap_mb={bucket_cap_mb!r} must be positive"
    if device_ids:
        devices = {p.device for p in module.parameters()}
        wanted = torch.device(device_ids[0]) if not isinstance(device_ids[0], int) \
            else torch.device("cuda", device_ids[0])
        if devices and devices != {wanted}:
            return f"device_ids={device_ids} but the module is on {sorted(map(str, devices))}"
    return None


def _make_buckets(params: list[torch.nn.Parameter], cap: int) -> list[_Bucket]:
    """Buckets of consecutive parameters in reverse registration order, one dtype and device
    each (mpidist.core.buffers.make_buckets over each dtype's parameters), the first of each at
    most 1 MiB and the others at most ``cap`` bytes (a larger parameter gets a bucket of its
    own); ordered by when backward fills them."""
    kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, p in enumerate(params):
        kinds.setdefault((p.dtype, p.device), []).append(i)
    buckets: list[tuple[int, _Bucket]] = []
    for (dtype, _), indices in kinds.items():
        specs, offset = [], 0
        for i in indices:
            specs.append(TensorSpec(str(i), tuple(params[i].shape), offset))
            offset += params[i].numel()
        for b in make_buckets(specs, offset, cap, dtype.itemsize,
                              first_bytes=_FIRST_BUCKET_BYTES):
            members = [int(name) for name in b.names]
            buckets.append((-max(members), _Bucket([params[i] for i in members])))
    return [b for _, b in sorted(buckets, key=lambda kb: kb[0])]
