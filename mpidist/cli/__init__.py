"""The ``mpidist`` command line.

A failure ends in one line: bad input that every rank finds alike is printed by rank 0
and every rank exits with status 2; an error on one rank alone ends the whole MPI job
(``MPI_Abort``), so no rank is left waiting (:func:`mpidist.run.launch.guard.report_failure`).
Usage errors and ``--help`` are printed by rank 0 only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from mpidist._version import __version__

__all__ = ["build_parser", "main"]


def _cmd_env(args: argparse.Namespace) -> int:
    """Collective over COMM_WORLD: every rank reports, rank 0 prints."""
    from mpidist.core.comms import world
    from mpidist.run.launch import detect_environment, launcher_from_env_summary
    from mpidist.run.launch.env import layout_by_node

    comm = world()
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
    print(f"fault tolerance : {first['fault_tolerance_line']}")
    others = sorted({r["fault_tolerance_line"] for r in rows} - {first["fault_tolerance_line"]})
    for line in others:
        ranks = [r["rank"] for r in rows if r["fault_tolerance_line"] == line]
        print(f"                  ranks {' '.join(map(str, ranks))}: {line}")
    print(f"{'rank':>4} {'local':>5} {'host':<24} {'pid':>8} GPU")
    for row in rows:
        print(f"{row['rank']:>4} {row['local_rank']:>5}/{row['local_size']:<3} "
              f"{row['host']:<24} {row['pid']:>8} {row['cuda']}")
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
    from mpidist.run.launch.env import launcher_from_env

    return launcher_from_env()["rank"] or 0


def _launcher_size() -> int | None:
    """How many ranks the launcher started (None when no launcher said), without MPI."""
    from mpidist.run.launch.env import launcher_from_env

    return launcher_from_env()["size"]


class _Parser(argparse.ArgumentParser):
    """Prints (usage, errors, help) on rank 0 only: every rank parses the same flags."""

    #: the subcommands' parsers, by name (on the top-level parser)
    subcommands: dict[str, argparse.ArgumentParser] = {}

    def _print_message(self, message: str, file: Any = None) -> None:
        if _rank() == 0:
            super()._print_message(message, file)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        """argparse's exit; on an error under a launcher of several ranks, every rank (each
        reached the same error on the same flags) first waits for the others, so that no
        rank's exit status makes the launcher end rank 0 before its message is out."""
        if message:
            self._print_message(message, sys.stderr)
        if status and (_launcher_size() or 1) > 1:
            sys.stderr.flush()
            from mpidist.core.comms import world

            world().Barrier()
        sys.exit(status)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """As argparse's, but an unknown flag after a subcommand is reported with that
        subcommand's usage (``mpidist train --bogus`` shows ``train``'s flags)."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            # the subcommand is the first word that names one (the top level's own flags
            # take no value); its namespace entry may have been reused by its arguments
            words = sys.argv[1:] if args is None else list(args)
            name = next((w for w in words if w in self.subcommands), None)
            where = self.subcommands[name] if name is not None else self
            where.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mpidist`` command."""
    p = _Parser(
        prog="mpidist",
        description="MPI-native distributed training. Run under mpiexec/srun for more ranks.",
    )
    p.add_argument("--version", action="version", version=f"mpidist {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    env = sub.add_parser("env", help="print what each rank sees: MPI, HDF5, Numba/CUDA, ranks")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    env.set_defaults(func=_cmd_env)
    from mpidist.cli import demo, doctor, prepare, train
    from mpidist.cli import tools as tools_cli
    from mpidist.parallel import plan
    from mpidist.run.launch import supervisor

    train.add_parser(sub)
    prepare.add_parser(sub)
    supervisor.add_parser(sub)
    tools_cli.add_parsers(sub)
    plan.add_parser(sub)
    demo.add_parser(sub)
    doctor.add_parser(sub)
    p.subcommands = dict(sub.choices)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mpidist`` console script.

    A failure is one line (:func:`mpidist.run.launch.guard.report_failure`): bad input that
    every rank finds alike is printed once and every rank exits with status 2; a failure
    of one rank aborts the MPI job, its line first.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from mpidist.core.failure import leave_if_survived
    from mpidist.run.launch.guard import report_failure

    # A process that outlived a lost rank ends without MPI_Finalize (leave_if_survived).
    try:
        return leave_if_survived(int(args.func(args) or 0))
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        return 0
    except SystemExit as exc:
        if exc.code in (0, None):
            raise
        raise SystemExit(leave_if_survived(report_failure(exc, f"mpidist {args.command}"))
                         ) from None
    except BaseException as exc:  # noqa: BLE001 - every failure ends in one line
        raise SystemExit(leave_if_survived(report_failure(exc, f"mpidist {args.command}"))
                         ) from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
