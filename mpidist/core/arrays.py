"""The array library the engine computes with: NumPy on the CPU, CuPy on a CUDA device.

The layers, buffers and optimizers are written once against an *array namespace* ``xp``:
the module whose functions make and combine the arrays (``xp.zeros``, ``xp.matmul``,
``xp.tanh``, ...). NumPy and CuPy share that API, so one code path serves both.

- :func:`namespace` gives the namespace of arrays already made (``numpy`` for NumPy arrays
  and Python scalars; ``x.__array_namespace__()`` for any other array; CuPy's module for
  CuPy arrays). A layer takes it from its input and never names NumPy for arrays it computes.
- :class:`Device` is where a model's buffers are allocated: its ``xp`` and, for CUDA, the
  GPU index. :func:`device` resolves ``"cpu"`` or ``"cuda"`` (CuPy is imported only then);
  a ``Device`` built by hand selects any other array library (the tests run the device
  path on a fake array type that refuses NumPy-only calls).
- :func:`to_host` copies any array into a NumPy array (checkpoints, logs, host-side checks).

Ranks map to GPUs by their index on the node modulo the GPU count; several ranks may share
one GPU (a warning says so). Nothing here communicates except :func:`device`, which asks
the node's ranks for their local index (collective over ``comm``) when CUDA is chosen.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["CPU", "DEVICES", "Device", "as_array", "as_like", "device", "is_cpu",
           "is_floating", "is_host", "namespace", "to_host"]

#: device names accepted by ``--device`` and ``device=``
DEVICES = ("cpu", "cuda")


def namespace(*arrays: Any) -> Any:
    """The array namespace of ``arrays`` (NumPy when every one is a NumPy array or scalar).

    Raises TypeError when the arrays come from two different libraries, as mixing a host
    and a device array would. Not collective."""
    found: Any = None
    for a in arrays:
        if a is None or isinstance(a, (np.ndarray, np.generic, int, float, bool)):
            continue
        xp = _namespace_of(a)
        if found is not None and xp is not found:
            raise TypeError(f"arrays of two libraries mixed: {found.__name__} and {xp.__name__}")
        found = xp
    return np if found is None else found


def _namespace_of(a: Any) -> Any:
    get = getattr(a, "__array_namespace__", None)
    if get is not None:
        return get()
    module = type(a).__module__.split(".")[0]
    if module == "cupy":
        import cupy

        return cupy
    raise TypeError(f"{type(a).__name__} is not an array of a known array library")


def is_host(a: Any) -> bool:
    """Whether ``a`` is a NumPy array or scalar (host memory). Not collective."""
    return isinstance(a, (np.ndarray, np.generic))


def as_array(x: Any) -> Any:
    """``x`` as an array: ``np.asarray(x)`` for host values (NumPy arrays, lists, numbers),
    ``x`` itself for an array of another library (it has a shape and a dtype). Not
    collective."""
    if is_host(x) or not (hasattr(x, "shape") and hasattr(x, "dtype")):
        return np.asarray(x)
    return x


def as_like(ref: Any, x: Any) -> Any:
    """``x`` as an array of ``ref``'s library: ``x`` itself when it is one, a copy to the
    device when ``x`` is a host array (or list, or number) and ``ref`` a device array.
    Not collective."""
    return _into(namespace(ref), x)


def _into(xp: Any, x: Any) -> Any:
    if xp is np:
        return np.asarray(x)
    if is_host(x) or isinstance(x, (list, tuple, int, float)):
        return xp.asarray(np.ascontiguousarray(x))
    return x


def is_floating(dtype: Any) -> bool:
    """Whether ``dtype`` is a floating-point type, bfloat16 included (ml_dtypes registers it
    with NumPy as kind "V"). Not collective."""
    dt = np.dtype(dtype)
    return dt.kind == "f" or dt.name == "bfloat16"


def to_host(a: Any) -> np.ndarray:
    """``a`` as a NumPy array: itself when it is one, else a copy of a device array
    (CuPy's ``.get()``, a Numba device array's ``copy_to_host()``). Synchronous."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "get") and not isinstance(a, dict):
        return np.asarray(a.get())
    if hasattr(a, "copy_to_host"):
        return np.asarray(a.copy_to_host())
    return np.asarray(a)


@dataclass(frozen=True)
class Device:
    """Where arrays live: ``name`` ("cpu", "cuda", or another library's name), its array
    namespace ``xp`` and, on CUDA, the GPU ``index`` this rank uses."""

    name: str
    xp: Any = field(repr=False)
    index: int | None = None

    @property
    def is_cpu(self) -> bool:
        """True when the arrays are NumPy arrays."""
        return self.xp is np

    def zeros(self, shape: Any, dtype: Any) -> Any:
        """A new zero-filled array on this device."""
        return self.xp.zeros(shape, dtype=dtype)

    def asarray(self, a: Any) -> Any:
        """``a`` on this device (a copy when it lives elsewhere; ``a`` itself when it is
        already an array of this device's library): :func:`as_like` for a device."""
        return _into(self.xp, a)

    def __str__(self) -> str:
        return self.name if self.index is None else f"{self.name}:{self.index}"


CPU = Device("cpu", np)


def is_cpu(spec: str | Device | None) -> bool:
    """Whether a ``device=`` value means the CPU (NumPy), without resolving it. Pure."""
    if isinstance(spec, Device):
        return spec.is_cpu
    return spec is None or (isinstance(spec, str) and spec.strip().lower() == "cpu")


def device(spec: str | Device | None = "cpu", *, comm: Any = None) -> Device:
    """Resolve ``spec`` ("cpu", "cuda", "cuda:N", a :class:`Device`, or None for the CPU).

    For CUDA, CuPy is imported (a clear ImportError names what is missing). With "cuda"
    the rank takes GPU ``local_index % gpu_count``, where the local index is its rank
    among the ranks of ``comm`` on its node (``Split_type``: collective over ``comm``,
    ``MPI.COMM_WORLD`` when None); the node's first rank warns when several ranks share
    one GPU. "cuda:N" takes GPU N and is not collective."""
    if spec is None:
        return CPU
    if isinstance(spec, Device):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"device={spec!r} must be one of {DEVICES} (or 'cuda:N')")
    name, _, idx = spec.strip().lower().partition(":")
    if name == "cpu" and not idx:
        return CPU
    if name != "cuda" or (idx and not idx.isdigit()):
        raise ValueError(f"device={spec!r} must be one of {DEVICES} (or 'cuda:N')")
    xp = _cupy(spec)
    count = int(xp.cuda.runtime.getDeviceCount())
    if count < 1:
        raise RuntimeError(f"device={spec!r}: CuPy sees no CUDA device on this node")
    if idx:  # a GPU named: nothing to ask the other ranks
        index = int(idx)
        if index >= count:
            raise ValueError(f"device={spec!r}: this node has {count} GPU(s)")
    else:
        local, per_node = _local_index(comm)
        index = local % count
        if per_node > count and local == 0:
            warnings.warn(f"{per_node} ranks share {count} GPU(s) on this node (local rank "
                          f"r uses GPU r % {count})", stacklevel=2)
    xp.cuda.Device(index).use()
    from numba import cuda  # the kernels' launches go to the same GPU

    cuda.select_device(index)
    return Device("cuda", xp, index)


def _cupy(spec: str) -> ModuleType:
    try:
        import cupy
    except ImportError as e:
        raise ImportError(f"device={spec!r} needs CuPy (pip install cupy-cuda12x or "
                          f"cupy-cuda13x for the machine's CUDA): {e}") from None
    return cupy


def _local_index(comm: Any) -> tuple[int, int]:
    """(this rank's index among its node's ranks, ranks on the node)."""
    if comm is None:
        if "mpi4py.MPI" not in sys.modules:
            return _env_local_index()
    from mpi4py import MPI

    from mpidist.core.comms import world

    shared = world(comm).Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return shared.Get_rank(), shared.Get_size()
    finally:
        shared.Free()


def _env_local_index() -> tuple[int, int]:
    for rank, size in (("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                       ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
                       ("MPI_LOCALRANKID", "MPI_LOCALNRANKS")):
        if os.environ.get(rank, "").isdigit():
            n = os.environ.get(size, "")
            return int(os.environ[rank]), int(n) if n.isdigit() else 1
    return 0, 1
