"""Mixed backends (``"cpu:mpidist,cuda:nccl"``): the tensors of a device that another backend
serves go to that backend, created on first use. torch stops building backends once a
Python ProcessGroup is returned for one device, so the "mpidist" group builds the others.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["handoff", "make_backend", "parse_config"]


def handoff(name: str, where: tuple[int, ...], options: Any = None,
            at: int | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """In a mixed group, hand the call to the backend that serves the device of the tensor
    at ``args[where[0]][where[1]]``, as its method ``name`` (with default ``options`` at
    argument ``at`` when the caller gave none); otherwise run the decorated method."""
    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(self: Any, *args: Any) -> Any:
            t: Any = args
            for i in where:
                t = t[i] if len(t) > i else None
                if t is None:
                    break
            other = self.backend_for(t.device.type) if isinstance(t, torch.Tensor) else None
            if other is None:
                return method(self, *args)
            if options is not None and at is not None and (len(args) <= at or
                                                           args[at] is None):
                args = (*args[:at], options())
            return getattr(other, name)(*args)
        return run
    return wrap


def parse_config(text: str) -> dict[str, str]:
    """``"cpu:mpidist,cuda:nccl"`` as ``{"cpu": "mpidist", "cuda": "nccl"}``."""
    out = {}
    for part in text.split(","):
        if ":" in part:
            device, name = part.split(":", 1)
            out[device.strip()] = name.strip().lower()
    return out


def make_backend(name: str, device: str, store: Any, rank: int, size: int,
                 timeout: timedelta, group_name: str) -> Any:
    """torch's backend ``name`` for the ``device`` tensors of a mixed group (collective over
    the group, through its key-value ``store``)."""
    if store is None:
        raise RuntimeError(f"group {group_name!r} has no store to create {name} with")
    store = dist.PrefixStore(f"{device}/", store)
    if name == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if name == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    plugin = dist.Backend._plugins.get(name.upper())
    if plugin is None:
        raise ValueError(f"backend {name!r} for {device} tensors is not known to torch")
    if not plugin.extended_api:
        return plugin.creator_fn(store, rank, size, timeout)
    options = dist.distributed_c10d._DistributedBackendOptions()
    options.store, options.group_rank, options.group_size = store, rank, size
    options.timeout, options.group_id = timeout, group_name
    return plugin.creator_fn(options, None)
