"""Arrays on a CUDA device as MPI buffers: any array exposing ``__cuda_array_interface__``
(Numba device arrays, CuPy arrays, torch CUDA tensors) or a Numba device array.

How device memory reaches MPI:

- **CUDA-aware MPI** (``MPI.Query_cuda_support()`` says so, or ``MPIDIST_CUDA_AWARE=1``;
  ``MPIDIST_CUDA_AWARE=0`` forces staging): the device buffer goes to MPI directly, after the
  device is synchronised, so the kernels that produce it have finished before MPI reads it.
- **otherwise, staged**: the values are copied into a pinned host buffer (Numba waits for
  the producing stream the array interface names, and the copy itself completes before it
  returns), MPI works on the host buffer, and results are copied back to the device.

Arrays are viewed, never copied, as Numba device arrays (:func:`view`): this gives one
type with ``dtype``, ``size``, ``copy_to_host`` and ``copy_to_device`` whatever library made
the array. Under the Numba CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) "device" memory is
host memory: the simulator's arrays, and objects whose interface points at host memory,
are viewed the same way, which is how the tests run this module without a GPU.

Not collective: these are local copies and checks.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["copy", "copy_to_host", "cuda_aware", "is_device", "numba_cuda", "pinned_empty", "scale",
           "stage", "view"]


def _removed_row_stack(*arrays: Any, **kwargs: Any) -> Any:
    """Stand-in for ``numpy.row_stack`` (an alias of ``numpy.vstack`` that NumPy 2.5
    removed), so that numba-cuda releases that still register an overload of it compile."""
    return np.vstack(*arrays, **kwargs)


def numba_cuda() -> Any:
    """``numba.cuda``, usable with NumPy >= 2.5. Not collective.

    numba-cuda up to at least 0.30 registers an overload of ``np.row_stack`` when it
    compiles its first kernel, unguarded, and NumPy 2.5 removed that alias: every kernel
    launch then fails with ``AttributeError: module 'numpy' has no attribute 'row_stack'``.
    Where the alias is missing it is put back (as a function of its own, calling
    ``np.vstack``) before ``numba.cuda`` is imported; nothing else of NumPy is touched."""
    if not hasattr(np, "row_stack"):
        np.row_stack = _removed_row_stack  # noqa: NPY201 - put back for numba-cuda
    from numba import cuda

    return cuda


def is_device(a: Any) -> bool:
    """Whether ``a`` is a device array: it exposes ``__cuda_array_interface__`` (or is the
    Numba simulator's device array, which marks itself with ``__cuda_ndarray__``)."""
    return not isinstance(a, np.ndarray) and (
        hasattr(a, "__cuda_array_interface__") or hasattr(a, "__cuda_ndarray__")
    )


def cuda_aware() -> bool:
    """Whether MPI takes device buffers directly: ``MPIDIST_CUDA_AWARE`` when set (1 or 0),
    else what mpi4py's ``MPI.Query_cuda_support()`` reports (False where it cannot ask)."""
    env = os.environ.get("MPIDIST_CUDA_AWARE")
    if env is not None:
        return env.strip().lower() not in ("", "0", "false", "no", "off")
    try:
        from mpi4py import MPI

        return bool(MPI.Query_cuda_support())
    except Exception:  # an MPI or mpi4py too old for the query
        return False


def view(a: Any, *, sync: bool = True) -> Any:
    """``a`` as a Numba device array sharing its memory (``a`` itself when it is one).
    Real CUDA: ``numba.cuda.as_cuda_array``, which waits for the stream the interface
    names (version 3 of the interface) unless ``sync=False``: a kernel argument launched
    on the same (default) stream as the work that made it needs no wait."""
    if hasattr(a, "copy_to_host") and hasattr(a, "copy_to_device"):
        return a
    cuda = numba_cuda()
    if hasattr(cuda, "as_cuda_array"):
        return cuda.as_cuda_array(a, sync=sync)
    return _simulated(a)


def _finish_copy(d: Any) -> None:
    """Wait for a copy queued on the device array's stream (a copy to or from pinned
    memory on a stream returns before it is done; MPI must not read the buffer sooner)."""
    stream = getattr(d, "stream", 0)
    if stream:
        stream.synchronize()


def _simulated(a: Any) -> Any:
    """The simulator's device array over the host memory an interface points at."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    cai = a.__cuda_array_interface__
    dt = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    if cai.get("strides") not in (None, _c_strides(shape, dt.itemsize)):
        raise ValueError(f"device array of strides {cai['strides']} is not C-contiguous")
    count = int(np.prod(shape)) if shape else 1
    if not count:
        return FakeCUDAArray(np.empty(shape, dtype=dt))
    raw = (ctypes.c_byte * (count * dt.itemsize)).from_address(cai["data"][0])
    raw._owner = a  # the view keeps the array whose memory it reads alive
    return FakeCUDAArray(np.frombuffer(raw, dtype=dt, count=count).reshape(shape))


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def stage(a: Any, *, read: bool = True) -> tuple[Any, Callable[[Any], None] | None]:
    """The buffer MPI uses for ``a`` and a function that copies a result in it back to
    ``a`` (None when nothing is to be copied). Host arrays are used as they are; a device
    array goes directly when MPI is CUDA-aware (after synchronising the device), else
    through a pinned host buffer holding its values (``read=False``: an output, not
    filled)."""
    if not is_device(a):
        return a, None
    cuda = numba_cuda()

    d = view(a)
    if cuda_aware():
        cuda.synchronize()
        return d, None
    host = cuda.pinned_array(d.shape, dtype=d.dtype)
    if read:
        d.copy_to_host(host)
        _finish_copy(d)

    def back(result: Any) -> None:
        d.copy_to_device(result)
        _finish_copy(d)

    return host, back


def pinned_empty(nbytes: int) -> np.ndarray:
    """A new uninitialised host array of ``nbytes`` bytes (uint8) in pinned (page-locked)
    memory, which copies from and to a device reach by DMA, without a staging copy.
    Needs Numba's CUDA (or its simulator)."""
    return numba_cuda().pinned_array((int(nbytes),), dtype=np.uint8)


def copy_to_host(dst: np.ndarray, src: Any) -> None:
    """Copy the device array ``src`` straight into the host array ``dst`` (same shape and
    dtype; pinned memory from :func:`pinned_empty` makes it one DMA), waiting for the
    copy. Synchronous."""
    d = view(src)
    d.copy_to_host(dst.reshape(d.shape))
    _finish_copy(d)


def copy(dst: Any, src: Any) -> None:
    """Copy the elements of ``src`` into ``dst`` (host or device, any pairing, same size).
    Synchronous."""
    if is_device(src):
        src = view(src).copy_to_host()
    src = np.ascontiguousarray(src).reshape(-1)
    if is_device(dst):
        d = view(dst)
        d.copy_to_device(src.reshape(d.shape))
    else:
        np.copyto(dst.reshape(-1), src)


_SCALE: dict[str, Any] = {}
_SCALE_SOURCE = """
def scale(x, factor, divisor, floating):
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        if floating:
            x[i] = x[i] * factor
        else:
            x[i] = x[i] // divisor
"""


def scale(a: Any, n: int) -> None:
    """Divide ``a`` by ``n`` in place: multiply by ``1/n`` for floats, floor-divide
    integers. Host arrays with NumPy; device arrays with a small kernel."""
    if not is_device(a):
        if a.dtype.kind == "f":
            a *= a.dtype.type(1.0 / n)
        else:
            a //= n
        return
    d = view(a).reshape(-1)
    if "kernel" not in _SCALE:
        cuda = numba_cuda()

        # ``cuda`` must be a global of the kernel (the simulator swaps globals only).
        scope: dict[str, Any] = {"cuda": cuda}
        exec(compile(_SCALE_SOURCE, "<mpidist.core.devices.scale>", "exec"), scope)  # noqa: S102
        _SCALE["kernel"] = cuda.jit(scope["scale"])
    floating = d.dtype.kind == "f"
    factor = d.dtype.type(1.0 / n) if floating else d.dtype.type(0)
    blocks = max(1, min(4096, (d.shape[0] + 255) // 256))
    _SCALE["kernel"][blocks, 256](d, factor, d.dtype.type(n), floating)
