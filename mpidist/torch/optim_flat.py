"""The multi-tensor ("flat") layout behind :mod:`mpidist.torch.optim`'s Adam and AdamW.

Per parameter group, the parameters are split into buckets of one device and dtype whose
elements lie in ONE contiguous range of one storage, so that a step is one fused kernel launch
per bucket instead of one per parameter:

* parameters that already tile a contiguous range of a shared storage (the flat buffer of
  ``ZeroRedundancyOptimizer`` or of mpidist's ``fully_shard``) are used where they are;
* parameters that own their storage are copied into one new flat tensor per (device, dtype)
  and their ``.data`` re-pointed to their views of it (as torch's FSDP does with flat params);
* DTensors, non-contiguous, empty, aliased and non-float32/float64 parameters keep the
  per-parameter path.

Each bucket has flat ``exp_avg``/``exp_avg_sq``(/``max_exp_avg_sq``) tensors; ``state[p][name]``
is the parameter's view of them, so torch's ``state_dict``/``load_state_dict`` work unchanged (a
state tensor that is not the bucket's view, e.g. after ``load_state_dict``, is copied in at the
next step). A bucket also has one flat gradient: a gradient that is not its view is copied in
(one ``torch._foreach_copy_``) and ``p.grad`` becomes the view, so a following backward without
``zero_grad(set_to_none=True)`` accumulates straight into it. A launch covers each run of
consecutive parameters that have a gradient and the same step count; a parameter without a
gradient is not updated and its step does not advance, as in torch.

Not collective: everything here touches this rank's tensors only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mpidist.optim import fused_adam

__all__ = ["FlatAdam", "adam_update", "kernel_array", "local_tensor"]

_NAMES = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel updates: a DTensor's local shard, else ``t``. Not collective."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def kernel_array(t: torch.Tensor, what: str) -> Any:
    """A flat view the kernels take: a NumPy view of a CPU tensor, the CUDA tensor itself
    (its ``__cuda_array_interface__``) flattened. Raises ValueError for a non-contiguous
    tensor. Not collective."""
    t = local_tensor(t).detach()
    if not t.is_contiguous():
        raise ValueError(f"{what} is not contiguous; the fused update needs contiguous "
                         "parameters, gradients and state")
    flat = t.view(-1)
    return flat.numpy() if flat.device.type == "cpu" else flat


def adam_update(arrays: list[Any], group: dict[str, Any], step: float,
                decoupled: bool) -> None:
    """One :func:`~mpidist.optim.fused_adam` launch on kernel arrays ``[param, grad, exp_avg,
    exp_avg_sq(, max_exp_avg_sq)]`` at step count ``step`` (already advanced) with ``group``'s
    hyper-parameters. Not collective."""
    beta1, beta2 = (float(b) for b in group["betas"])
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    decoupled = group.get("decoupled_weight_decay", decoupled)
    l2, decay = (0.0, 1.0 - lr * wd) if decoupled else (wd, 1.0)
    fused_adam(*arrays[:4], arrays[4] if len(arrays) > 4 else None,
               step_size=lr / (1.0 - beta1**step),
               bias_correction2_sqrt=(1.0 - beta2**step) ** 0.5,
               beta1=beta1, beta2=beta2, eps=float(group["eps"]), weight_decay=l2, decay=decay,
               grad_scale=-1.0 if group["maximize"] else 1.0)


def _flattenable(p: torch.Tensor) -> bool:
    return (not hasattr(p, "placements") and p.layout == torch.strided and p.numel() > 0
            and p.dtype in (torch.float32, torch.float64) and p.is_contiguous())


def _owns_storage(p: torch.Tensor) -> bool:
    return (p.storage_offset() == 0
            and p.untyped_storage().nbytes() == p.numel() * p.element_size())


class _Bucket:
    """Parameters (in storage order) that are views of one contiguous flat tensor."""

    def __init__(self, params: list[torch.Tensor], flat: torch.Tensor) -> None:
        self.params, self.flat = params, flat
        self.sizes = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.sizes[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.ptrs = [p.data_ptr() for p in params]
        self.flats: dict[str, torch.Tensor] = {}
        self.views: dict[str, list[torch.Tensor]] = {}
        self.arrays: dict[str, Any] = {}
        self._add("param", flat)
        self.steps = torch.zeros(len(params), dtype=scalar_dtype())
        self.step_views = list(self.steps)
        self.state_of: Any = None  # the optimizer's state dict the views were put into
        self.own = [False] * len(params)  # whose state was made the bucket's views
        self.ready: tuple[str, ...] = ()  # the state names, once all of them are

    def _add(self, name: str, flat: torch.Tensor) -> None:
        self.flats[name] = flat
        self.views[name] = [v.view_as(p) for v, p in
                            zip(flat.split(self.sizes), self.params, strict=True)]

    def buffer(self, name: str) -> list[torch.Tensor]:
        """The views of flat buffer ``name`` (``grad`` or a state name), made on first use."""
        if name not in self.flats:
            self._add(name, torch.zeros_like(self.flat))
        return self.views[name]

    def array(self, name: str, lo: int, hi: int) -> Any:
        """The kernel array of buffer ``name`` over parameters ``lo..hi-1``."""
        if lo == 0 and hi == len(self.params):
            if name not in self.arrays:
                self.arrays[name] = kernel_array(self.flats[name], name)
            return self.arrays[name]
        start, end = self.offsets[lo], self.offsets[hi - 1] + self.sizes[hi - 1]
        return kernel_array(self.flats[name][start:end], name)

    def moved(self) -> bool:
        """Whether a parameter no longer points where the bucket put it."""
        return any(p.data_ptr() != q for p, q in zip(self.params, self.ptrs, strict=True))


def _owned_bucket(params: list[torch.Tensor]) -> _Bucket:
    """Copy ``params`` into one new flat tensor and re-point each ``.data`` to its view."""
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype,
                       device=params[0].device)
    for view, p in zip(flat.split([p.numel() for p in params]), params, strict=True):
        view.copy_(p.detach().view(-1))
        p.data = view.view_as(p)
    return _Bucket(params, flat)


def _shared_buckets(params: list[torch.Tensor], rest: list[torch.Tensor]) -> list[_Bucket]:
    """Buckets over the runs of ``params`` (views of one storage) that tile it without gaps;
    with any overlap (aliased parameters) they all go to ``rest``."""
    params = sorted(params, key=lambda t: t.storage_offset())
    runs: list[list[torch.Tensor]] = [[params[0]]]
    for p in params[1:]:
        end = runs[-1][-1].storage_offset() + runs[-1][-1].numel()
        if p.storage_offset() < end:
            rest.extend(params)
            return []
        if p.storage_offset() == end:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [_Bucket(run, run[0].detach().as_strided((sum(p.numel() for p in run),), (1,),
                                                     run[0].storage_offset()))
            for run in runs]


def _make_buckets(params: list[torch.Tensor]) -> tuple[list[_Bucket], list[torch.Tensor]]:
    rest: list[torch.Tensor] = []
    by_storage: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for p in params:
        if _flattenable(p):
            key = (p.device, p.dtype, p.untyped_storage().data_ptr())
            by_storage.setdefault(key, []).append(p)
        else:
            rest.append(p)
    owned: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    buckets: list[_Bucket] = []
    for key, ps in by_storage.items():
        if len(ps) == 1 and _owns_storage(ps[0]):
            owned.setdefault(key[:2], []).append(ps[0])
        else:
            buckets += _shared_buckets(ps, rest)
    buckets += [_owned_bucket(ps) for ps in owned.values()]
    return buckets, rest


@dataclass
class _Group:
    params: list[torch.Tensor]
    buckets: list[_Bucket] = field(default_factory=list)
    rest: list[torch.Tensor] = field(default_factory=list)


class FlatAdam:
    """The flat buckets of one Adam/AdamW optimizer, built at the first step of each group
    and rebuilt when the group's parameters change or move. Not collective."""

    def __init__(self, decoupled: bool) -> None:
        self.decoupled = decoupled
        self.groups: dict[int, _Group] = {}

    def step_group(self, index: int, group: dict[str, Any],
                   state: dict[Any, dict[str, Any]]) -> list[torch.Tensor]:
        """Update the flattenable parameters of ``group`` (the ``index``-th); returns those
        left to the per-parameter path."""
        params = group["params"]
        g = self.groups.get(index)
        if (g is None or len(g.params) != len(params)
                or any(a is not b for a, b in zip(g.params, params, strict=True))
                or any(b.moved() for b in g.buckets)):
            g = _Group(list(params), *_make_buckets(list(params)))
            self.groups[index] = g
        names = _NAMES[:3 if group["amsgrad"] else 2]
        for bucket in g.buckets:
            self._step_bucket(bucket, group, state, names)
        return g.rest

    def _step_bucket(self, b: _Bucket, group: dict[str, Any],
                     state: dict[Any, dict[str, Any]], names: tuple[str, ...]) -> None:
        live = [i for i, p in enumerate(b.params) if p.grad is not None]
        if not live:
            return
        grads = b.buffer("grad")
        dst, src = [], []
        for i in live:
            p = b.params[i]
            if p.grad is not grads[i]:
                if p.grad.is_sparse:
                    raise ValueError("mpidist.torch.optim: sparse gradients are not "
                                     "supported")
                dst.append(grads[i])
                src.append(p.grad)
        if dst:
            torch._foreach_copy_(dst, src)
            for i in live:
                b.params[i].grad = grads[i]
        counts = self._state_in(b, live, state, names)
        run = 0
        for k in range(1, len(live) + 1):
            if k < len(live) and live[k] == live[k - 1] + 1 and counts[k] == counts[run]:
                continue
            lo, hi = live[run], live[k - 1] + 1
            b.steps[lo:hi] += 1
            arrays = [b.array(n, lo, hi) for n in ("param", "grad", *names)]
            adam_update(arrays, group, float(counts[run]) + 1.0, self.decoupled)
            run = k

    @staticmethod
    def _state_in(b: _Bucket, live: list[int], state: dict[Any, dict[str, Any]],
                  names: tuple[str, ...]) -> list[float]:
        """Make each live parameter's state the bucket's views (new state: zeros and step 0;
        state put there by someone else, e.g. ``load_state_dict``: copied in); returns the
        step counts. The step counters are 0-dim views of one flat tensor (on the CPU, of
        torch's scalar dtype), so a run's counters advance in one op."""
        if (state is b.state_of and b.ready == names and len(live) == len(b.params)):
            return b.steps.tolist()
        views = [b.buffer(n) for n in names]
        if state is not b.state_of or b.ready != names:
            b.state_of, b.own = state, [False] * len(b.params)
        for i in live:
            st = state[b.params[i]]
            step = st.get("step")
            if step is not b.step_views[i]:
                b.steps[i] = 0.0 if step is None else float(step)
                st["step"] = b.step_views[i]
            for name, view in zip(names, views, strict=True):
                v = st.get(name)
                if v is not view[i]:
                    if v is None:
                        view[i].zero_()
                    else:
                        view[i].copy_(v)
                    st[name] = view[i]
            b.own[i] = True
        b.ready = names if all(b.own) else ()
        return b.steps[live].tolist()


def scalar_dtype() -> torch.dtype:
    """The dtype of a step counter, as torch keeps it. Not collective."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
