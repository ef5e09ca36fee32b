"""The fault-tolerance tests: programs started under the ULFM stack, ranks killed.

They start their own mpiexec (never mpi-marked) and run only where asked: ``make test-ft``
(all of them) and ``make test-ft-smoke`` (the ``ft_smoke`` cases, part of ``make test``)
set MPIDIST_TEST_FT=1 and install the stack first (``make ulfm``). Without the stack they
skip and say why.
"""

from __future__ import annotations

import functools
import os

import pytest
from ulfm_harness import run_job, ulfm_missing


@pytest.fixture(autouse=True)
def _only_where_asked():
    if os.environ.get("MPIDIST_TEST_FT") != "1":
        pytest.skip("fault-tolerance test: run by make test-ft / make test-ft-smoke "
                    "(MPIDIST_TEST_FT=1)")


@pytest.fixture
def ulfm(tmp_path):
    """``run_job`` (ulfm_harness) with this test's directory: ``ulfm("prog.py", n=4, ...)``;
    skips when the ULFM stack is not installed."""
    reason = ulfm_missing()
    if reason:
        pytest.skip(reason)
    return functools.partial(run_job, tmp=tmp_path)
