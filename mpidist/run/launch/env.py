"""What the process sees of its launch: rank, local rank, nodes, launcher, libraries."""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = [
    "RuntimeEnvironment",
    "detect_environment",
    "layout_by_node",
    "launcher_from_env",
    "launcher_from_env_summary",
]

# (launcher, rank, size, local rank, local size, node count); first match wins.
_LAUNCHER_VARS = (
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
     "SLURM_NNODES"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", None),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None),
)


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value.split("(")[0].split(",")[0])
    except ValueError:
        return None


def launcher_from_env(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Rank information that the launcher put in the environment. Pure; no MPI.

    Returns ``{"launcher": name, "rank": .., "size": .., "local_rank": .., "local_size": ..,
    "nodes": ..}`` with None for what the launcher did not say; ``launcher`` is "none" when no
    known variables are set. Slurm's variables are only trusted inside a step (SLURM_STEP_ID),
    since a batch script's own shell also sees SLURM_PROCID=0.
    """
    env = os.environ if environ is None else environ
    keys = ("rank", "size", "local_rank", "local_size", "nodes")
    for name, *variables in _LAUNCHER_VARS:
        if name == "slurm" and "SLURM_STEP_ID" not in env:
            continue
        if variables[0] in env:
            return {"launcher": name, **{k: _int(env.get(v)) if v else None
                                         for k, v in zip(keys, variables, strict=True)}}
    return {"launcher": "none", **dict.fromkeys(keys)}


def launcher_from_env_summary() -> dict[str, Any]:
    """:func:`launcher_from_env` of this process, plus the Slurm job facts if any."""
    out = launcher_from_env()
    for key in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NTASKS", "SLURM_CPUS_ON_NODE"):
        if key in os.environ:
            out[key.lower()] = os.environ[key]
    return out


def layout_by_node(rows: list[dict[str, Any]]) -> list[str]:
    """One line per node from the ranks' reports (``rank`` and ``host`` keys): the node's
    ranks, nodes in the order of their lowest rank. Pure."""
    nodes: dict[str, list[int]] = {}
    for row in sorted(rows, key=lambda r: r["rank"]):
        nodes.setdefault(row["host"], []).append(row["rank"])
    return [f"{host}: {len(ranks)} rank(s) {' '.join(map(str, ranks))}"
            for host, ranks in nodes.items()]


@dataclass(frozen=True)
class RuntimeEnvironment:
    """One rank's view of the job and its libraries (see :func:`detect_environment`)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    nodes: int
    host: str
    pid: int  #: this rank's process id (flight-recorder dumps name ranks by host:pid)
    launcher: str
    mpi_library: str
    mpi4py_version: str
    cuda_aware_mpi: bool
    h5py_version: str
    h5py_mpi: bool
    hdf5_version: str
    numba_version: str
    cuda: str
    #: in-job recovery from a dead rank possible (:func:`mpidist.core.ft.fault_tolerance`)
    fault_tolerance: bool = False
    #: ``on (...)`` or ``off: <why>``
    fault_tolerance_line: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _h5py_info() -> tuple[str, bool, str]:
    try:
        import h5py
    except ImportError:
        return "not installed", False, "unknown"
    return h5py.__version__, bool(h5py.get_config().mpi), h5py.version.hdf5_version


def _cuda_info() -> str:
    try:
        import numba
    except ImportError:
        return "numba not installed"
    sim = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    try:
        from mpidist.core.devices import numba_cuda

        cuda = numba_cuda()
    except ImportError:
        return "numba.cuda not importable"
    try:
        available = cuda.is_available()
    except Exception as exc:  # driver errors surface here
        return f"unavailable ({type(exc).__name__})"
    if sim:
        return "simulator (NUMBA_ENABLE_CUDASIM=1)"
    if not available:
        return f"no GPU (numba {numba.__version__})"
    try:
        device = cuda.get_current_device()
        name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
        return f"GPU {device.id} of {len(cuda.gpus)}: {name}"
    except Exception as exc:  # a driver that answers is_available but not the query
        return f"available ({type(exc).__name__})"


def detect_environment(comm: Any = None) -> RuntimeEnvironment:
    """Describe this rank's environment. Collective over ``comm`` (default COMM_WORLD).

    Rank and size come from MPI; local rank and node count from a shared-memory
    ``Split_type`` of ``comm`` (what the hardware says), which works under any launcher.
    """
    from mpi4py import MPI

    from mpidist.core.collectives import cuda_aware
    from mpidist.core.comms import world
    from mpidist.core.ft import fault_tolerance

    comm = world(comm)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    leaders = np.array([1 if local_rank == 0 else 0], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, leaders)
    h5v, h5mpi, hdf5v = _h5py_info()
    try:
        import numba

        numba_v = numba.__version__
    except ImportError:
        numba_v = "not installed"
    import mpi4py

    return RuntimeEnvironment(
        rank=comm.Get_rank(),
        size=comm.Get_size(),
        local_rank=local_rank,
        local_size=local_size,
        nodes=int(leaders[0]),
        host=socket.gethostname(),
        pid=os.getpid(),
        launcher=launcher_from_env()["launcher"],
        mpi_library=MPI.Get_library_version().replace("\0", "").strip().splitlines()[0],
        mpi4py_version=mpi4py.__version__,
        cuda_aware_mpi=cuda_aware(),
        h5py_version=h5v,
        h5py_mpi=h5mpi,
        hdf5_version=hdf5v,
        numba_version=numba_v,
        cuda=_cuda_info(),
        fault_tolerance=fault_tolerance().available,
        fault_tolerance_line=fault_tolerance().line(),
    )
