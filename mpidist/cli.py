"""The ``mpidist`` command line.

Every subcommand that runs under ``mpiexec``/``srun`` is wrapped in
:class:`~mpidist.launch.abort_on_failure`, so an error on one rank ends the whole job.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from mpidist._version import __version__

__all__ = ["build_parser", "main"]


def _cmd_env(args: argparse.Namespace) -> int:
    """Collective over COMM_WORLD: every rank reports, rank 0 prints."""
    from mpi4py import MPI

    from mpidist.launch import detect_environment, launcher_from_env_summary
    from mpidist.launch.env import layout_by_node

    comm = MPI.COMM_WORLD
    info = detect_environment(comm).as_dict()
    rows = _gather_json(info, comm)
    if comm.Get_rank() != 0:
        return 0
    if args.json:
        print(json.dumps({"ranks": rows, "launcher_env": launcher_from_env_summary()}, indent=2))
        return 0
    first = rows[0]
    print(f"mpidist {__version__}")
    print(f"MPI library     : {first['mpi_library']}")
    print(f"mpi4py          : {first['mpi4py_version']} "
          f"(CUDA-aware MPI: {first['cuda_aware_mpi']})")
    print(f"h5py / HDF5     : {first['h5py_version']} / {first['hdf5_version']} "
          f"(MPI support: {first['h5py_mpi']})")
    print(f"numba           : {first['numba_version']}; CUDA: {first['cuda']}")
    print(f"launcher        : {first['launcher']}")
    print(f"world size      : {first['size']} on {first['nodes']} node(s)")
    print(f"{'rank':>4} {'local':>5} {'host':<24}")
    for row in rows:
        print(f"{row['rank']:>4} {row['local_rank']:>5}/{row['local_size']:<3} {row['host']:<24}")
    print("ranks by node   : " + "; ".join(layout_by_node(rows)))
    return 0


def _gather_json(obj: object, comm: object) -> list:
    """Gather one JSON-serialisable object per rank to rank 0 (no pickle). Collective."""
    import numpy as np
    from mpi4py import MPI

    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    counts = np.zeros(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([data.size], dtype=np.int64), counts)
    out = np.empty(int(counts.sum()), dtype=np.uint8) if comm.Get_rank() == 0 else None
    comm.Gatherv(data, [out, counts, None, MPI.BYTE] if out is not None else None, root=0)
    if out is None:
        return []
    rows, start = [], 0
    for c in counts:
        rows.append(json.loads(out[start : start + c].tobytes().decode()))
        start += int(c)
    return rows


def _rank() -> int:
    """This process's rank, without starting MPI just to ask."""
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized():
            return MPI.COMM_WORLD.Get_rank()
    from mpidist.launch.env import launcher_from_env

    return launcher_from_env()["rank"] or 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mpidist`` command."""
    p = argparse.ArgumentParser(
        prog="mpidist",
        description="MPI-native distributed training. Run under mpiexec/srun for more ranks.",
    )
    p.add_argument("--version", action="version", version=f"mpidist {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    env = sub.add_parser("env", help="print what each rank sees: MPI, HDF5, Numba/CUDA, ranks")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    env.set_defaults(func=_cmd_env)
    from mpidist import demo, plan, tools_cli, train
    from mpidist.launch import supervisor

    train.add_parser(sub)
    supervisor.add_parser(sub)
    tools_cli.add_parsers(sub)
    plan.add_parser(sub)
    demo.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mpidist`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from mpidist.launch import abort_on_failure

    with abort_on_failure():
        try:
            return int(args.func(args) or 0)
        except BrokenPipeError:  # output piped into head & co.
            sys.stderr.close()
            return 0
        except ValueError as exc:
            # Bad input: a message naming the value, not a traceback. Every rank validates
            # the same input, so every rank says the same; under MPI the job then aborts.
            rank = _rank()
            prefix = "" if rank == 0 else f"[rank {rank}] "
            sys.stderr.write(f"{prefix}mpidist {args.command}: error: {exc}\n")
            sys.stderr.flush()
            raise SystemExit(2) from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
