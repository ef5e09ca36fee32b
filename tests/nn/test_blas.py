"""NumPy's BLAS called from Numba-compiled code (mpidist.nn.blas): the product of every
transpose case with offsets and leading dimensions, the switch that turns it off, and
Numba's on-disk cache of a kernel that calls it, loaded in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from mpidist.nn import blas

pytestmark = pytest.mark.skipif(not blas.AVAILABLE,
                                reason="no BLAS callable from Numba found beside NumPy")


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("ta", [blas.NO_TRANS, blas.TRANS], ids=["A", "At"])
@pytest.mark.parametrize("tb", [blas.NO_TRANS, blas.TRANS], ids=["B", "Bt"])
def test_gemm_matches_numpy(dtype: type, ta: int, tb: int) -> None:
    """``C = alpha op(A) op(B) + beta C`` on sub-blocks of larger arrays (offsets, leading
    dimensions other than the width)."""
    from numba import njit

    @njit
    def call(ta, tb, m, n, k, alpha, a, a_off, lda, b, b_off, ldb, beta, c, c_off, ldc):
        blas.gemm(ta, tb, m, n, k, alpha, a, a_off, lda, b, b_off, ldb, beta, c, c_off, ldc)

    m, n, k = 5, 7, 3
    rng = np.random.default_rng(0)
    big_a = rng.standard_normal((9, 11)).astype(dtype)
    big_b = rng.standard_normal((10, 12)).astype(dtype)
    c = rng.standard_normal((8, 13)).astype(dtype)
    a = big_a[2:2 + (k if ta == blas.TRANS else m), 1:1 + (m if ta == blas.TRANS else k)]
    b = big_b[1:1 + (n if tb == blas.TRANS else k), 3:3 + (k if tb == blas.TRANS else n)]
    opa = a.T if ta == blas.TRANS else a
    opb = b.T if tb == blas.TRANS else b
    want = c.copy()
    want[1:1 + m, 2:2 + n] = 0.5 * opa @ opb + 2.0 * c[1:1 + m, 2:2 + n]
    call(ta, tb, m, n, k, dtype(0.5), big_a, 2 * 11 + 1, 11, big_b, 1 * 12 + 3, 12, dtype(2.0),
         c, 1 * 13 + 2, 13)
    rtol = 1e-14 if dtype == np.float64 else 1e-6
    np.testing.assert_allclose(c, want, rtol=rtol, atol=rtol)


_PROBE = """
import numpy as np
from mpidist.nn import blas, fused as F
from mpidist.nn.attention import causal_attention, causal_attention_backward
rng = np.random.default_rng(0)
qkv = rng.standard_normal((2, 70, 24))
y, saved = causal_attention(qkv, 2)
g = causal_attention_backward(y, saved)
print(blas.AVAILABLE, F.attention_kernel_applies(qkv), repr(float(y.sum())), repr(float(g.sum())))
"""


def _probe(env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.split()


def test_cache_is_valid_in_a_fresh_process_and_switch_off(tmp_path) -> None:
    """A kernel calling the BLAS compiles into Numba's cache and loads from it in the next
    process with the same results; ``MPIDIST_NN_BLAS=0`` leaves the BLAS alone and the
    attention on NumPy's products, to round-off the same."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path)}
    first = _probe(env)
    assert any(p.name.startswith("attention_cpu.attention_forward")
               for p in tmp_path.rglob("*.nbi"))
    second = _probe(env)
    assert first[:2] == ["True", "True"] and second == first
    off = _probe({**env, "MPIDIST_NN_BLAS": "0"})
    assert off[:2] == ["False", "False"]
    np.testing.assert_allclose([float(v) for v in off[2:]], [float(v) for v in first[2:]],
                               rtol=1e-12)
