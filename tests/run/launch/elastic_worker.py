"""A small elastic training job for the tests (run under mpiexec; joiners run it too).

    elastic_worker.py --strategy S --steps N --out DIR [--min A --max B]
        [--actions "STEP:ACTION,..."] [--checkpoint-interval I] [--resume]
        [--hook none|topk:RATIO|localsgd:PERIOD|async:STALENESS] [--pp P] [--fixed]

``--pp P`` runs a hybrid mesh (P pipeline stages, dp = workers / P); ``--fixed`` runs the
same strategy with a plain :class:`ShardedOptimizer` (no membership changes, no actions).

Actions run after the step with that number, on the worker of the current rank named:
``leave@R`` (request_leave), ``sigterm@R`` (SIGTERM to itself), ``scale=N`` (rank 0 asks for
N workers), ``kill@R`` (SIGKILL to itself; only on the first launch; rewrites the file in
``ELASTIC_SLOTS_FILE`` to ``ELASTIC_SLOTS_AFTER`` first, as if a node went away).
Rank 0 writes ``final.npz`` (the final parameters) and ``losses.json`` under DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import numpy as np

from mpidist.data import GlobalBatchSampler, synthetic_regression
from mpidist.nn import MLP, MSELoss
from mpidist.optim import AdamW
from mpidist.parallel import ShardingConfiguration
from mpidist.parallel.compression import Compression
from mpidist.parallel.elastic import ElasticOptimizer
from mpidist.parallel.engine import ShardedOptimizer
from mpidist.parallel.hooks import AsyncSGD, GradientHook, LocalSGD
from mpidist.parallel.placement import LEVEL_NAMES

GLOBAL_BATCH = 12
SIZES = [7, 13, 11, 3]


def make_data():
    return synthetic_regression(96, SIZES[0], SIZES[-1], seed=1)


def make_base():
    return AdamW(lr=0.01, weight_decay=0.1)


def make_hook(text: str) -> GradientHook | None:
    kind, _, arg = text.partition(":")
    if kind == "topk":
        return Compression("topk", ratio=float(arg))
    if kind == "localsgd":
        return LocalSGD(int(arg))
    if kind == "async":
        return AsyncSGD(int(arg))
    if kind not in ("", "none"):
        raise ValueError(f"--hook {text!r}")
    return None


def parse_actions(text: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for item in filter(None, text.split(",")):
        step, _, action = item.partition(":")
        out.setdefault(int(step), []).append(action)
    return out


def act(opt: ElasticOptimizer, action: str, rank: int) -> None:
    first_launch = os.environ.get("MPIDIST_RESTART", "0") == "0"
    if action.startswith("scale="):
        if rank == 0:
            opt.scale_to(int(action.split("=")[1]))
        return
    what, _, who = action.partition("@")
    if int(who) != rank:
        return
    if what == "leave":
        opt.request_leave()
    elif what == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif what == "kill" and first_launch:
        slots = os.environ.get("ELASTIC_SLOTS_FILE")
        if slots:
            with open(slots, "w") as f:
                f.write(os.environ.get("ELASTIC_SLOTS_AFTER", "") + "\n")
        os.kill(os.getpid(), signal.SIGKILL)


#: ``"<phase>:<old rank>"``: that rank exits (status 3) when a resize reaches that phase,
#: on the first launch only (MPIDIST_RESTART unset or 0), so a supervisor's restart runs clean
FAULT_ENV = "ELASTIC_WORKER_FAULT"


def die(fault: str, phase: str, rank: int) -> None:
    want_phase, _, want_rank = fault.partition(":")
    if phase == want_phase and str(rank) == want_rank.strip():
        sys.stderr.write(f"[worker {rank}] {FAULT_ENV}={fault}: exiting during {phase}\n")
        sys.stderr.flush()
        os._exit(3)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("--min", type=int, default=1)
    p.add_argument("--max", type=int, default=8)
    p.add_argument("--actions", default="")
    p.add_argument("--checkpoint-interval", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--hook", default="none")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--fixed", action="store_true")
    args = p.parse_args()
    actions = parse_actions(args.actions)

    data = make_data()
    config = ShardingConfiguration(dtype="float64", micro_batches=2 if args.pp > 1 else 1)
    if args.fixed:
        return run_fixed(args, data, config)
    joiner = ElasticOptimizer.is_joiner()
    opt = ElasticOptimizer(make_base(), config, min_workers=args.min, max_workers=args.max,
                           strategy=args.strategy, hook=make_hook(args.hook),
                           pipeline_parallel_size=args.pp, loss=MSELoss(),
                           events=os.path.join(args.out, "events.jsonl"))
    fault = os.environ.get(FAULT_ENV, "")
    if fault and os.environ.get("MPIDIST_RESTART", "0") in ("", "0"):
        opt.on_phase(lambda phase, rank: die(fault, phase, rank))
    model = opt.wrap(MLP(SIZES), seed=0)
    opt.sampler = GlobalBatchSampler(len(data), GLOBAL_BATCH, seed=0)
    if args.resume and not joiner:
        from mpidist.checkpoint import latest_checkpoint
        from mpidist.checkpoint.training import load_training

        path = latest_checkpoint(args.out)
        if path is not None:
            load_training(path, opt, comm=opt.comm)
    losses = {}
    while opt.step_count < args.steps:
        idx = opt.sampler.next_local(model.dp_rank, model.dp_size)
        loss = opt.step(model, data.batch(idx))
        s = opt.step_count
        losses[s] = loss
        if args.checkpoint_interval and s % args.checkpoint_interval == 0:
            from mpidist.checkpoint.training import save_training

            save_training(args.out, opt, step=s, keep=3, comm=opt.comm)
        for action in actions.get(s, []):
            act(opt, action, opt.comm.Get_rank())
        model = opt.maybe_rescale(model)
        if model is None:
            return 0  # this worker left
    write_results(args.out, model, losses, opt.comm.Get_rank(), opt.current_workers)
    opt.free()
    return 0


def write_results(out: str, model, losses: dict[int, float], rank: int, workers: int) -> None:
    params = model.full_parameters()
    if rank == 0:
        np.savez(os.path.join(out, "final.npz"), **params)
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump({"losses": losses, "workers": workers}, f)


def run_fixed(args: argparse.Namespace, data, config: ShardingConfiguration) -> int:
    """The same strategy without elasticity: the uninterrupted run to compare with."""
    from mpi4py import MPI

    opt = ShardedOptimizer(make_base(), config, level=LEVEL_NAMES.index(args.strategy),
                           hook=make_hook(args.hook), pipeline_parallel_size=args.pp,
                           loss=MSELoss())
    model = opt.wrap(MLP(SIZES), seed=0)
    sampler = GlobalBatchSampler(len(data), GLOBAL_BATCH, seed=0)
    losses = {}
    while opt.step_count < args.steps:
        idx = sampler.next_local(model.dp_rank, model.dp_size)
        loss = opt.step(model, data.batch(idx))
        losses[opt.step_count] = loss
    write_results(args.out, model, losses, MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    model.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
