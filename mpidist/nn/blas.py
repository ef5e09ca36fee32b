"""NumPy's own BLAS matrix product, callable from Numba-compiled code.

The attention kernels (:mod:`mpidist.nn.attention_cpu`) run a head's small matrix products
and its softmax one after the other while the head's T x T block is still in cache. For that
they call ``cblas_?gemm`` themselves, the same routine NumPy's ``matmul`` calls, found in the
BLAS library that NumPy has loaded (the OpenBLAS of NumPy's wheels; a BLAS that exports
``cblas_sgemm``/``cblas_dgemm`` otherwise). :func:`gemm` is a Numba intrinsic that compiles
to a direct call; the routine's address is registered with LLVM under a fixed name when this
module is imported, so Numba's on-disk cache of a kernel stays valid in a later process.

Where no such library is found (another platform, a NumPy without a bundled BLAS),
:data:`AVAILABLE` is False and callers keep NumPy's ``matmul``; ``MPIDIST_NN_BLAS=0`` forces
that too. Integer arguments are passed as 64-bit values, which both the 32-bit (LP64) and
the 64-bit (ILP64) integer interfaces read correctly on x86-64 and AArch64; a 2 x 2 product
is checked against NumPy before the library is used. Nothing here communicates.
"""

from __future__ import annotations

import ctypes
import glob
import os
from pathlib import Path

import numpy as np

try:  # Numba is a dependency of mpidist; without it the layers use NumPy's products alone.
    import llvmlite.binding as llvm
    from llvmlite import ir
    from numba import njit
    from numba.core import cgutils, types
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised only without numba
    llvm = None

__all__ = ["AVAILABLE", "LIBRARY", "NO_TRANS", "TRANS", "add_transposed_product", "gemm"]

NO_TRANS = 111  # CblasNoTrans
TRANS = 112  # CblasTrans
_ROW_MAJOR = 101
# (single, double) routine names, most specific first: NumPy 2 wheels' scipy-openblas64,
# an ILP64 OpenBLAS with the usual suffix, then the plain CBLAS names.
_NAMES = (
    ("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_"),
    ("cblas_sgemm64_", "cblas_dgemm64_"),
    ("cblas_sgemm", "cblas_dgemm"),
)
SYMBOLS = {np.dtype(np.float32): "mpidist_cblas_sgemm", np.dtype(np.float64): "mpidist_cblas_dgemm"}


def _candidates() -> list[str]:
    """Shared libraries that may hold NumPy's BLAS: those this process has mapped whose
    name says BLAS, then those shipped beside NumPy."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                name = os.path.basename(path).lower()
                if path.startswith("/") and "blas" in name and ".so" in name:
                    paths.append(path)
    except OSError:
        pass
    root = Path(np.__file__).resolve().parent
    for pattern in ("../numpy.libs/*blas*", ".dylibs/*blas*", "../numpy/.dylibs/*blas*"):
        paths += sorted(glob.glob(str(root / pattern)))
    return list(dict.fromkeys(paths))


def _checked(fn: ctypes._CFuncPtr, ctype: type, dtype: type) -> bool:
    """Whether ``fn`` computes a 2 x 2 row-major product with a transpose as NumPy does."""
    a = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=dtype)
    b = np.array([[5.0, 6.0], [7.0, 8.0]], dtype=dtype)
    c = np.full((2, 2), 1.0, dtype=dtype)
    i64 = ctypes.c_int64
    fn.restype = None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, i64, i64, i64, ctype,
                   ctypes.c_void_p, i64, ctypes.c_void_p, i64, ctype, ctypes.c_void_p, i64]
    fn(_ROW_MAJOR, NO_TRANS, TRANS, 2, 2, 2, 2.0, a.ctypes.data, 2, b.ctypes.data, 2, 1.0,
       c.ctypes.data, 2)
    return bool(np.array_equal(c, 2.0 * a @ b.T + 1.0))


def _find() -> tuple[str | None, dict[np.dtype, int]]:
    if llvm is None or os.environ.get("MPIDIST_NN_BLAS", "1") == "0":
        return None, {}
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for single, double in _NAMES:
            try:
                s, d = getattr(lib, single), getattr(lib, double)
            except AttributeError:
                continue
            if _checked(s, ctypes.c_float, np.float32) and _checked(d, ctypes.c_double,
                                                                    np.float64):
                return path, {np.dtype(np.float32): ctypes.cast(s, ctypes.c_void_p).value,
                              np.dtype(np.float64): ctypes.cast(d, ctypes.c_void_p).value}
    return None, {}


#: Path of the library whose ``gemm`` the kernels call (None: not found or disabled).
LIBRARY, _ADDRESSES = _find()
#: Whether :func:`gemm` may be called.
AVAILABLE = LIBRARY is not None

if AVAILABLE:
    for _dt, _addr in _ADDRESSES.items():
        llvm.add_symbol(SYMBOLS[_dt], _addr)


def add_transposed_product(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """``out += a.T @ b`` (``a`` (N, K), ``b`` (N, M), ``out`` (K, M)) as one BLAS call that
    accumulates into ``out`` (no temporary product) where :data:`AVAILABLE` and the three
    arrays are C-contiguous NumPy arrays of one float dtype; otherwise with the arrays' own
    library (``a.T @ b``: cuBLAS for CuPy arrays). Not collective."""
    if (AVAILABLE and all(isinstance(x, np.ndarray) for x in (out, a, b))
            and out.dtype in SYMBOLS and a.dtype == b.dtype == out.dtype
            and a.ndim == b.ndim == out.ndim == 2 and a.shape[0] == b.shape[0]
            and out.shape == (a.shape[1], b.shape[1])
            and a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous):
        _add_transposed_product(out, a, b)
    else:
        out += a.T @ b


if llvm is not None:
    @intrinsic
    def gemm(typingctx, trans_a, trans_b, m, n, k, alpha, a, a_off, lda, b, b_off, ldb, beta, c,
             c_off, ldc):  # pragma: no cover - compiled
        """``gemm(trans_a, trans_b, m, n, k, alpha, a, a_off, lda, b, b_off, ldb, beta, c, c_off,
        ldc)`` in compiled code: ``C = alpha op(A) op(B) + beta C`` (row major), where ``A``
        starts at element ``a_off`` of the array ``a`` and has leading dimension ``lda`` (likewise
        ``B`` and ``C``), and ``trans_*`` are :data:`NO_TRANS` or :data:`TRANS`. Arrays of one
        float dtype. Call it only where :data:`AVAILABLE`: elsewhere the routine is not linked."""
        dt = c.dtype
        if not (isinstance(dt, types.Float) and all(isinstance(x, types.Array) and x.dtype == dt
                                                    for x in (a, b, c))):
            return None
        sig = types.void(trans_a, trans_b, m, n, k, alpha, a, a_off, lda, b, b_off, ldb, beta, c,
                         c_off, ldc)
        name = SYMBOLS[np.dtype(str(dt))]

        def codegen(context, builder, signature, args):
            i32, i64 = ir.IntType(32), ir.IntType(64)
            ft = context.get_value_type(dt)
            fp = ft.as_pointer()
            fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, ft, fp, i64, fp,
                                                   i64, ft, fp, i64])
            fn = cgutils.get_or_insert_function(builder.module, fnty, name)
            tys = signature.args

            def cast(i, to):
                return context.cast(builder, args[i], tys[i], to)

            def ptr(i):  # array i, offset by the element count that follows it
                arr = context.make_array(tys[i])(context, builder, args[i])
                return builder.gep(arr.data, [cast(i + 1, types.int64)])

            builder.call(fn, [
                ir.Constant(i32, _ROW_MAJOR), builder.trunc(cast(0, types.int64), i32),
                builder.trunc(cast(1, types.int64), i32), cast(2, types.int64),
                cast(3, types.int64), cast(4, types.int64), cast(5, dt), ptr(6),
                cast(8, types.int64), ptr(9), cast(11, types.int64), cast(12, dt), ptr(13),
                cast(15, types.int64),
            ])
            return context.get_dummy_value()

        return sig, codegen


    @njit(cache=True, nogil=True)
    def _add_transposed_product(out, a, b):  # pragma: no cover - compiled
        n, k = a.shape
        m = b.shape[1]
        one = out.dtype.type(1)
        gemm(TRANS, NO_TRANS, k, m, n, one, a, 0, k, b, 0, m, one, out, 0, m)
else:  # pragma: no cover - exercised only without numba
    gemm = None
