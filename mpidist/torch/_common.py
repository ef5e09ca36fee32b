"""What the torch wrappers share: the communicator (used as given, no duplicate), agreement
checks (one small allgather, so that every rank raises the same error before any collective
that could hang), host views of tensors.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from mpidist.core import collectives as C
from mpidist.core.comms import world

__all__ = [
    "REDUCIBLE",
    "HostView",
    "agree",
    "broadcast_tensors",
    "overlap",
    "module_fingerprint",
    "numpy_dtype",
    "resolve_comm",
]

# Reductions run in MPI on these element types (mpidist.core.collectives' reducible types).
REDUCIBLE = (torch.float32, torch.float64)


def overlap() -> bool:
    """Whether the wrappers overlap communication with computation through nonblocking MPI
    collectives, from ``MPIDIST_TORCH_OVERLAP`` (``1``: overlap; default ``0``: each
    collective runs blocking where it is needed; docs/torch.md says why). Not collective;
    every rank must see the same value."""
    value = os.environ.get("MPIDIST_TORCH_OVERLAP", "0").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"MPIDIST_TORCH_OVERLAP={value!r} must be 0 or 1")
    return value in ("1", "true", "yes", "on")


def resolve_comm(comm: Any = None, process_group: Any = None) -> Any:
    """The communicator a wrapper works on: ``comm``, else ``process_group`` when it is an
    mpi4py communicator, else ``MPI.COMM_WORLD``. Not collective."""
    from mpi4py import MPI

    if comm is not None and process_group is not None:
        raise ValueError("pass the communicator as comm= or process_group=, not both")
    comm = world(comm if comm is not None else process_group)
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(
            f"comm={comm!r} is not an mpi4py intracommunicator (mpidist.torch runs on MPI; "
            "pass e.g. MPI.COMM_WORLD or a communicator from comm.Split)"
        )
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL: this rank is not part of the group")
    return comm


def agree(comm: Any, what: str, error: str | None, items: Sequence[str] = ()) -> None:
    """Collective over ``comm``: raise the same error on every rank when any rank passed an
    ``error`` or when the ranks' ``items`` differ (naming the ranks and the first entries that
    differ from rank 0's); return silently otherwise.

    One allgather of a digest (plus one of the items themselves only when they differ).
    """
    digest = hashlib.sha256("\n".join(items).encode()).hexdigest()
    if comm.Get_size() == 1:
        if error is not None:
            raise ValueError(f"{what}: {error}")
        return
    everyone = comm.allgather((error, digest))
    errors = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if errors:
        detail = "; ".join(f"rank {r}: {e}" for r, e in errors[:4])
        more = f" (and {len(errors) - 4} more ranks)" if len(errors) > 4 else ""
        raise ValueError(f"{what}: {detail}{more}")
    digests = [d for _, d in everyone]
    if len(set(digests)) == 1:
        return
    lists = comm.allgather(list(items))
    ref = lists[0]
    lines = []
    for r, mine in enumerate(lists):
        if mine == ref:
            continue
        extra_mine = [x for x in mine if x not in ref]
        extra_ref = [x for x in ref if x not in mine]
        if extra_mine or extra_ref:
            lines.append(f"rank {r} has {extra_mine[:3]} where rank 0 has {extra_ref[:3]}")
        else:
            lines.append(f"rank {r} has the same entries as rank 0 in another order")
    raise ValueError(f"{what} differ between ranks: " + "; ".join(lines[:4]))


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} {t.device.type}"


def module_fingerprint(module: torch.nn.Module,
                       extra: Iterable[str] = ()) -> tuple[list[str], str | None]:
    """Entries naming every parameter and buffer of ``module`` (name, shape, dtype, device
    type, requires_grad), and a local error: mixed devices or a 16-bit floating parameter.
    Not collective."""
    items = list(extra)
    devices = set()
    error = None
    for name, p in module.named_parameters():
        items.append(f"param {name} {_describe(p)} grad={p.requires_grad}")
        devices.add(str(p.device))
        if p.requires_grad and p.dtype not in REDUCIBLE and error is None:
            error = (f"parameter {name!r} has dtype {p.dtype}; mpidist.torch reduces "
                     "float32 and float64 gradients")
    for name, b in module.named_buffers():
        items.append(f"buffer {name} {_describe(b)}")
        devices.add(str(b.device))
    if len(devices) > 1 and error is None:
        error = f"the module's tensors are on several devices {sorted(devices)}; use one"
    return items, error


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy element type of a torch dtype (ValueError for types NumPy lacks)."""
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:
        raise ValueError(f"dtype {dtype} has no NumPy equivalent") from None


class HostView:
    """A NumPy (or CUDA-array) view of a contiguous torch tensor for MPI.

    CPU tensors are viewed without a copy. CUDA tensors go to MPI directly when MPI is
    CUDA-aware (as reported by mpi4py, or ``MPIDIST_CUDA_AWARE=1``), else they are staged
    through a host copy: :meth:`to_device` copies the host result back.
    """

    def __init__(self, t: torch.Tensor) -> None:
        if not t.is_contiguous():
            raise ValueError("tensor must be contiguous for MPI")
        self.tensor = t
        self.staged: torch.Tensor | None = None
        if t.device.type == "cpu":
            self.array: Any = t.detach().numpy()
        elif C.cuda_aware():
            from numba import cuda

            self.array = cuda.as_cuda_array(t.detach())
        else:
            self.staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self.array = self.staged.numpy()

    def to_host(self) -> Any:
        """Copy a staged device tensor to the host; returns the array MPI uses."""
        if self.staged is not None:
            self.staged.copy_(self.tensor.detach())
        return self.array

    def to_device(self) -> None:
        """Copy a staged host result back into the tensor (no-op when not staged)."""
        if self.staged is not None:
            with torch.no_grad():
                self.tensor.copy_(self.staged)


def broadcast_tensors(tensors: Sequence[torch.Tensor], comm: Any, root: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with ``root``'s values, one broadcast per dtype.

    Collective over ``comm``; every rank passes tensors of the same shapes and dtypes in the
    same order (checked beforehand by the wrappers' fingerprint).
    """
    if comm.Get_size() == 1 or not tensors:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for ts in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])  # a copy, also of one tensor
        view = HostView(flat)
        C.broadcast(view.to_host(), root, comm=comm)
        view.to_device()
        with torch.no_grad():
            for t, piece in zip(ts, flat.split([t.numel() for t in ts]), strict=True):
                t.copy_(piece.view_as(t))
