"""Each rank's verdict of mpidist.core.ft.fault_tolerance (event ``ft``)."""

import ftprog  # noqa: I001 - first: output capture and pid

import os

from mpidist.core.ft import fault_tolerance

ft = fault_tolerance()
ftprog.event("ft", env=os.environ.get("OMPI_MCA_mpi_ft_enable"), line=ft.line(),
             **ft.as_dict())
