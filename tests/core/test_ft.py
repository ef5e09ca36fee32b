"""The verdict on in-job recovery (mpidist.core.ft) from given facts, and in this process.
Runs under a launcher of either stack are in tests/ft (make test-ft)."""

from __future__ import annotations

import pytest

from mpidist.core.ft import assess_fault_tolerance, fault_tolerance, mpi_ft_enable

OMPI5 = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"
OMPI4 = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4"
MPICH = "MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 12:29:21 CST 2024"


def test_on_only_when_every_link_holds():
    on = assess_fault_tolerance(OMPI5, "4.1.2", ft_enabled=True, source="MPI_T")
    assert on.available and on.reason == ""
    assert on.line() == "on (Open MPI v5.0.11, ULFM, mpi_ft_enable from MPI_T)"
    assert on.as_dict()["library"] == OMPI5


@pytest.mark.parametrize(("library", "mpi4py", "kw", "says"), [
    (OMPI5, "3.1.6", {"ft_enabled": True}, "mpi4py 3.1.6 has no ULFM calls"),
    (OMPI4, "4.1.2", {"ft_enabled": True}, "Open MPI v4.1.4 has no fault tolerance"),
    (MPICH, "4.1.2", {"ft_enabled": True}, "the MPI library is MPICH Version:      4.2.0"),
    ("", "4.1.2", {"ft_enabled": True}, "the MPI library is unknown"),
    (OMPI5, "4.1.2", {"ft_enabled": True, "missing_symbols": ("MPIX_Comm_shrink",)},
     "built without fault tolerance (no MPIX_Comm_shrink)"),
    (OMPI5, "4.1.2", {"ft_enabled": True, "missing_calls": ("Shrink",)},
     "mpi4py 4.1.2 lacks Comm.Shrink"),
    (OMPI5, "4.1.2", {"ft_enabled": False}, "did not turn it on (mpi_ft_enable is false)"),
    (OMPI5, "4.1.2", {"ft_enabled": None}, "cannot tell whether fault tolerance is on"),
])
def test_off_says_why(library, mpi4py, kw, says):
    verdict = assess_fault_tolerance(library, mpi4py, **kw)
    assert not verdict.available
    assert says in verdict.reason
    assert verdict.line() == f"off: {verdict.reason}"
    assert "\n" not in verdict.reason


def test_unknown_symbols_do_not_decide():
    # where the library could not be opened to look, the other links decide
    verdict = assess_fault_tolerance(OMPI5, "4.1.2", ft_enabled=True, missing_symbols=None)
    assert verdict.available


def test_mpi_ft_enable_from_the_environment(monkeypatch):
    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable", raising=False)
    assert mpi_ft_enable() == (None, "unknown")
    for value, expected in (("1", True), ("true", True), ("0", False), ("false", False)):
        monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", value)
        assert mpi_ft_enable() == (expected, "environment")


def test_this_process_gets_a_verdict_without_communicating():
    from mpi4py import MPI

    verdict = fault_tolerance()
    assert verdict is fault_tolerance()  # kept for the process
    assert verdict.library == MPI.Get_library_version().replace("\0", "").strip().splitlines()[0]
    if not verdict.library.startswith("Open MPI v5"):
        assert not verdict.available and verdict.reason
