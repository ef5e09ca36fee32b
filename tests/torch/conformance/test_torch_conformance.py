"""torch's own distributed conformance suite against a backend, under mpiexec (opt-in).

Skipped unless ``MPIDIST_CONFORMANCE=1``. Then it runs ``conformance_driver`` (which starts
its own ``mpiexec`` jobs, so this test must not itself run under MPI) and fails on any
failed, errored or hung test that ``conformance_known.KNOWN_FAILURES`` does not list.

Settings: ``MPIDIST_CONFORMANCE_BACKEND`` (default ``mpidist``), ``MPIDIST_CONFORMANCE_NP``
(world sizes, comma-separated; default ``2``), ``MPIDIST_CONFORMANCE_ARGS`` (more driver
options, e.g. ``--all`` or ``-k all_reduce``).
"""

from __future__ import annotations

import os
import shlex

import pytest

if os.environ.get("MPIDIST_CONFORMANCE") != "1":
    pytest.skip("torch's distributed conformance suite: set MPIDIST_CONFORMANCE=1",
                allow_module_level=True)
if any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
    pytest.skip("the conformance run starts its own mpiexec jobs; run it outside MPI",
                allow_module_level=True)
pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch.testing._internal imports it

import conformance_driver as driver  # noqa: E402
from conformance_known import KNOWN_FAILURES  # noqa: E402

BACKEND = os.environ.get("MPIDIST_CONFORMANCE_BACKEND", "mpidist")
SIZES = [int(n) for n in os.environ.get("MPIDIST_CONFORMANCE_NP", "2").split(",") if n]


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("world_size", SIZES)
def test_conformance(world_size: int, tmp_path: os.PathLike[str]) -> None:
    """No failure beyond the known ones, and at least one test really ran."""
    argv = ["--backend", BACKEND, "-n", str(world_size), "--out", str(tmp_path)]
    report = driver.run(driver.parse(argv + shlex.split(
        os.environ.get("MPIDIST_CONFORMANCE_ARGS", ""))))
    summary = driver.format_report(report)
    print(summary)
    assert not report.fatal, summary
    assert report.counts()["run"] > 0, summary
    known = KNOWN_FAILURES.get(BACKEND, {})
    bad = report.bad()
    unexpected = sorted(n for n in bad if n not in known)
    ran = {n for n, t in report.tests.items() if t["outcome"] != "skipped"}
    fixed = sorted(n for n in known if n in ran and n not in bad)
    message = [summary]
    if unexpected:
        message.append("not in conformance_known.KNOWN_FAILURES: " + ", ".join(unexpected))
    if fixed:
        message.append("listed as known failures but did not fail (remove them from "
                       "conformance_known.KNOWN_FAILURES): " + ", ".join(fixed))
    assert not unexpected and not fixed, "\n".join(message)
