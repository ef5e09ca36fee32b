"""``mpidist train``: train the GPT on the embedded corpus (or ``--data``) with any strategy.

Launched as ``mpiexec -n N mpidist train ...`` or ``srun mpidist train ...``. A run is
defined by its global batch and seed, so the same flags on a different number of ranks give
the same losses. Every flag has a TOML key of the same name with ``_`` for ``-``
(``--global-batch`` ↔ ``global_batch``); flags given on the command line override the file.
On SIGTERM or SIGUSR1 every rank finishes its step, a checkpoint is written and the ranks
exit with status 75 (``--requeue``: after requeueing the Slurm job). Exit status: 0 done
(or nothing to do), 1 failed (diverged, crashed), 2 bad input, 75 preempted.

The loop and its outputs live in :mod:`mpidist.run`; this module is the subcommand.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from mpidist.run import EXIT_PREEMPTED, TrainConfig, add_train_arguments, load_toml, run_training

__all__ = ["EXIT_PREEMPTED", "TrainConfig", "add_parser", "load_toml", "run_training"]


def add_parser(sub: Any) -> None:
    """Register ``mpidist train`` and its flags (the command-line contract)."""
    p = sub.add_parser("train", help="train the GPT on the embedded corpus (under mpiexec/srun)",
                       description=__doc__.split("\n\n")[0],
                       epilog="On SIGTERM/SIGUSR1: finish the step, checkpoint, exit with "
                              f"status {EXIT_PREEMPTED}.")
    add_train_arguments(p)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from mpidist.core.comms import world
    from mpidist.run.launch.guard import enable_error_agreement

    if MPI.Comm.Get_parent() == MPI.COMM_NULL:  # not a worker spawned into an elastic job
        enable_error_agreement(world())
    flags = {f.name: getattr(args, f.name, None) for f in fields(TrainConfig)}
    toml = load_toml(args.config) if args.config else {}
    cfg = TrainConfig.from_sources(toml, flags)
    given = set(toml) | {k for k, v in flags.items() if v is not None}
    summary = run_training(cfg, world(), given=given)
    status = EXIT_PREEMPTED if summary.get("preempted") else 0
    if cfg.strategy != "elastic":  # a newcomer of growing back ends here (MPI_Finalize)
        from mpidist.run.regrow import before_exit

        before_exit(status)
    return status
