"""The pure parts of elastic training: the agreed decision, the Alltoallv transfer plan
(simulated for every member in one process), and the supervisor's arithmetic."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from mpidist.core.buffers import ShardedLayout
from mpidist.optim import SGD
from mpidist.parallel import ShardingConfiguration
from mpidist.parallel.elastic import (
    ElasticOptimizer,
    ResizeDecision,
    decide,
    membership,
    transfer_plan,
)
from mpidist.parallel.placement import Placement
from mpidist.parallel.resize import column_of
from mpidist.run.launch.supervisor import (
    Supervisor,
    add_parser,
    available_slots,
    launch_env,
    read_slots_file,
)

UNITS = [[("a", (3, 5)), ("b", (7,))], [("c", (11,))], [("d", (2, 2)), ("e", (1,))]]


def _vec(n, leave=(), target=0):
    v = [0] * (n + 1)
    for r in leave:
        v[r] = 1
    v[n] = target
    return v


def test_decide():
    assert not decide(_vec(4), 4, 1, 8).changes
    d = decide(_vec(4, leave=[2]), 4, 1, 8)
    assert (d.leavers, d.joins, d.n_new, d.kind) == ((2,), 0, 3, "leave")
    d = decide(_vec(2, target=4), 2, 1, 8)
    assert (d.leavers, d.joins, d.n_new, d.kind) == ((), 2, 4, "join")
    d = decide(_vec(4, target=2), 4, 1, 8)  # shrink: the highest ranks leave
    assert (d.leavers, d.n_new) == ((2, 3), 2)
    d = decide(_vec(4, leave=[0], target=4), 4, 1, 8)  # replace a leaver
    assert (d.leavers, d.joins, d.n_new, d.kind) == ((0,), 1, 4, "resize")
    d = decide(_vec(2, leave=[1]), 2, 2, 8)
    assert not d.changes and "below min_workers=2" in d.refused
    d = decide(_vec(2, target=5), 2, 1, 3)
    assert not d.changes and "above max_workers=3" in d.refused


#: the units of each pipeline stage when the simulated mesh has pp=2
STAGES = [UNITS[:2], UNITS[2:]]


def _simulate(d: ResizeDecision, sharded: bool, pp: int = 1, tp: int = 1) -> None:
    """Run the plan of every member by direct copies; compare with the new layouts.

    With pp=2 the stages hold different units; every (stage, tp rank) column holds its own
    values (tp ranks hold different slices of the same shapes), so an element sent to the
    wrong column is caught."""
    rng = np.random.default_rng(0)
    old_ranks, new_ranks = membership(d)
    size = len(old_ranks)
    stages = STAGES if pp == 2 else [UNITS]
    names = [[n for u in st for n, _ in u] for st in stages]

    def place(n: int, r: int) -> tuple[int, Placement]:
        col, dp_index = column_of(r, n, pp, tp)
        stage = col // tp
        return col, Placement(stages[stage], global_units=UNITS, stage_names=names,
                              stage=stage, level=1, n=n // (pp * tp), rank=dp_index)

    olds = {i: place(d.n_old, r) for i, r in enumerate(old_ranks) if r >= 0}
    news = {i: place(d.n_new, r) for i, r in enumerate(new_ranks) if r >= 0}
    numels = {c: [u.numel for u in p.layout.units] for c, p in [*olds.values(), *news.values()]}
    truth = {c: [rng.standard_normal(n) for n in ns] for c, ns in numels.items()}

    def make(col: int, place: Placement) -> np.ndarray:
        layout = place.layout
        full = np.zeros(layout.full_size)
        for u, n in enumerate(numels[col]):
            full[layout.units[u].full_offset:layout.units[u].full_offset + n] = truth[col][u]
        if not sharded:
            return full
        local = np.zeros(layout.local_size)
        for u in range(len(numels[col])):
            layout.unit_local(u, local)[:] = layout.unit_shard_of_full(u, full)
        return local

    src = {i: make(*cp) for i, cp in olds.items()}
    dst = {i: np.full(p.layout.full_size if not sharded else p.layout.local_size, np.nan)
           for i, (_, p) in news.items()}
    for i in news:  # padding stays zero
        want = make(*news[i])
        dst[i][want == 0] = 0.0
    plans = [transfer_plan(numels, d.n_old, d.n_new, old_ranks, new_ranks, me,
                           sharded=sharded, pp=pp, tp=tp) for me in range(size)]
    if not sharded:  # what _move does locally: only in a column the worker stays in
        for i in set(olds) & set(news):
            if olds[i][0] != news[i][0]:
                continue
            for u, n in enumerate(numels[olds[i][0]]):
                a = olds[i][1].unit_offset(u, 0, sharded=False)
                b = news[i][1].unit_offset(u, 0, sharded=False)
                dst[i][b:b + n] = src[i][a:a + n]
    for i in range(size):
        for j in range(size):
            assert plans[i][0][j] == plans[j][1][i]  # what i sends is what j expects
            if plans[i][0][j]:
                assert olds[i][0] == news[j][0]  # only within a column
            for u, a, b in plans[i][0][j]:
                so = olds[i][1].unit_offset(u, a, sharded=sharded)
                do = news[j][1].unit_offset(u, a, sharded=sharded)
                dst[j][do:do + b - a] = src[i][so:so + b - a]
    for i, cp in news.items():
        np.testing.assert_array_equal(dst[i], make(*cp))


@pytest.mark.parametrize("sharded", [True, False])
def test_transfer_plan_moves_every_element(sharded):
    cases = [(4, (2,), 0), (4, (1, 3), 0), (2, (), 2), (3, (), 1), (5, (0, 4), 3),
             (1, (), 3), (3, (2,), 1), (4, (0, 1, 2), 0)]
    for n_old, leavers, joins in cases:
        _simulate(ResizeDecision(n_old, leavers, joins), sharded)


@pytest.mark.parametrize("sharded", [True, False])
@pytest.mark.parametrize("pp,tp", [(2, 1), (1, 2), (2, 2)])
def test_hybrid_transfer_plan_moves_every_column(sharded, pp, tp):
    # dp 1 -> 2 -> 3 -> 1 by joins and leaves, leaves from any column, and a leave + join
    g = pp * tp
    cases = [(g, (), g), (2 * g, (), g), (3 * g, tuple(range(1, 3 * g, 3))[:2 * g], 0),
             (2 * g, (0,), 1), (2 * g, tuple(range(g)), g), (3 * g, (), 0)]
    for n_old, leavers, joins in cases:
        d = ResizeDecision(n_old, leavers, joins)
        if d.changes:
            assert d.n_new % g == 0
            _simulate(d, sharded, pp, tp)


def test_hybrid_column_changes():
    # pp=2: 2 -> 4 workers; old rank 1 (stage 1) becomes new rank 1 (stage 0, dp 1)
    assert [column_of(r, 2, 2, 1) for r in range(2)] == [(0, 0), (1, 0)]
    assert [column_of(r, 4, 2, 1) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [column_of(r, 4, 1, 2) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    d = ResizeDecision(2, (), 2)
    old, new = membership(d)
    numels = {0: [5, 3], 1: [4]}
    sends, recvs = transfer_plan(numels, 2, 4, old, new, 1, sharded=False, pp=2)
    assert sends == [[], [], [(0, 0, 4)], [(0, 0, 4)]]  # stage 1 to the joiners
    assert recvs == [[(0, 0, 5), (1, 0, 3)], [], [], []]  # its new stage 0 from rank 0
    with pytest.raises(ValueError, match="rank=3 of world_size=3"):
        column_of(3, 3, 1, 1)


def test_decide_hybrid_refuses_partial_groups():
    d = decide(_vec(4, leave=[1]), 4, 1, 8, pp=2)
    assert not d.changes and "multiple of pipeline_parallel_size=2" in d.refused
    d = decide(_vec(2, target=4), 2, 1, 8, pp=2)
    assert (d.n_new, d.joins, d.refused) == (4, 2, None)
    d = decide(_vec(4, target=2), 4, 1, 8, tp=2)
    assert (d.leavers, d.refused) == ((2, 3), None)
    d = decide(_vec(4, target=6), 4, 1, 8, pp=2, tp=2)
    assert "x tensor_parallel_size=2 = 4" in d.refused


def test_replicated_joiners_get_pieces_from_every_old_worker():
    d = ResizeDecision(3, (), 1)
    old_ranks, new_ranks = membership(d)
    numels = [u.numel for u in ShardedLayout(UNITS, 3).units]
    senders = [i for i in range(3) if transfer_plan(numels, 3, 4, old_ranks, new_ranks, i,
                                                    sharded=False)[0][3]]
    assert senders == [0, 1, 2]


def test_elastic_optimizer_arguments():
    base = SGD(lr=0.1)
    opt = ElasticOptimizer(base, ShardingConfiguration(), 2, 6, strategy="zero3",
                           handle_sigterm=False)
    assert (opt.current_workers, opt.min_workers, opt.max_workers) == (1, 2, 6)
    assert opt.strategy == "zero3" and opt.can_scale_up and not opt.can_scale_down
    with pytest.raises(ValueError, match="min_workers=3 is above max_workers=2"):
        ElasticOptimizer(base, None, 3, 2, handle_sigterm=False)
    with pytest.raises(ValueError, match="min_workers=0"):
        ElasticOptimizer(base, None, 0, 2, handle_sigterm=False)
    with pytest.raises(ValueError, match="strategy='hybrid'"):
        ElasticOptimizer(base, None, strategy="hybrid", handle_sigterm=False)
    with pytest.raises(ValueError, match="mesh=None"):
        ElasticOptimizer(base, ShardingConfiguration(mesh=object()), handle_sigterm=False)
    with pytest.raises(ValueError, match="scale_to"):
        opt.scale_to(0)


def test_sigterm_handler_is_given_back():
    import signal

    def mine(signum, frame):  # the program's own handler, before the optimizer's
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        opt = ElasticOptimizer(SGD(lr=0.1), ShardingConfiguration(), 1, 2)
        assert signal.getsignal(signal.SIGTERM) is not mine  # the optimizer's own
        opt.close()
        assert signal.getsignal(signal.SIGTERM) is mine
        opt.close()  # idempotent
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_slots(tmp_path):
    f = tmp_path / "slots"
    f.write_text("3\n")
    assert read_slots_file(str(f)) == 3
    f.write_text("# hosts\nnode1 slots=4\nnode2 slots=2\nnode3\n")
    assert read_slots_file(str(f)) == 7
    with pytest.raises(ValueError, match="no such file"):
        read_slots_file(str(tmp_path / "none"))
    assert available_slots(None, {"MPIDIST_SLOTS": "5", "SLURM_NTASKS": "8"}) == 5
    assert available_slots(None, {"SLURM_NTASKS": "8"}) == 8
    assert available_slots(None, {}) is None
    f.write_text("2\n")
    assert available_slots(str(f), {"MPIDIST_SLOTS": "5"}) == 2


def test_launch_env():
    env = launch_env(2, 1, 4, {"PATH": "/bin"})
    assert env["MPIDIST_RESTART"] == "2" and env["MPIDIST_MAX_WORKERS"] == "4"
    assert env["OMPI_MCA_async_mpi_finalize"] == "1"
    assert env["OMPI_MCA_rmaps_base_oversubscribe"] == "1"
    assert "OMPI_MCA_rmaps_base_oversubscribe" not in launch_env(0, 1, 4, {"SLURM_JOB_ID": "7"})


def test_supervisor_arguments_and_sizes(tmp_path):
    cmd = ["mpidist", "train", "--out", str(tmp_path / "o"), "--resume"]
    with pytest.raises(ValueError, match="-n 5 is outside"):
        Supervisor(cmd, 5, 1, 4)
    with pytest.raises(ValueError, match="no COMMAND"):
        Supervisor([], 2)
    slots = tmp_path / "slots"
    slots.write_text("8\n")
    sup = Supervisor(cmd, 4, 2, 6, slots_file=str(slots))
    assert sup.events == str(tmp_path / "o" / "events.jsonl")
    assert sup.workers_for(0, 4) == 4 and sup.workers_for(1, 4) == 6
    slots.write_text("3\n")
    assert sup.workers_for(1, 4) == 3
    slots.write_text("1\n")
    assert sup.run() == 1  # below min_workers: gives up without launching
    (row,) = [json.loads(x) for x in (tmp_path / "o" / "events.jsonl").read_text().splitlines()]
    assert row["event"] == "gave_up" and row["world_size"] == 1


def test_run_parser():
    import argparse

    p = argparse.ArgumentParser(prog="mpidist")
    add_parser(p.add_subparsers(dest="command_name"))
    args = p.parse_args(["run", "--elastic", "--min-workers", "2", "--max-workers", "4", "-n",
                         "3", "--max-restarts", "1", "--", "mpidist", "train", "--resume"])
    assert (args.n, args.min_workers, args.max_workers, args.max_restarts) == (3, 2, 4, 1)
    assert [w for w in args.command if w != "--"] == ["mpidist", "train", "--resume"]


@pytest.mark.parametrize("n_old,n_new", list(itertools.product([1, 2, 3], [1, 4])))
def test_membership_orders_stayers_then_joiners(n_old, n_new):
    d = decide(_vec(n_old, target=n_new), n_old, 1, 8)
    old, new = membership(d)
    assert sorted(r for r in new if r >= 0) == list(range(n_new))
    assert [r for r in old if r >= 0] == list(range(n_old))
