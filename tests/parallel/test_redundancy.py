"""The copies in-job recovery restores from (``redundancy="buddy"``), on any MPI: after
every step the holder's copy of its neighbour's shard is bitwise the neighbour's own state
(refreshed by replaying the update, never sent); the own snapshot holds the state at the
start of the step; training is unchanged by them. The recovery itself needs MPI's fault
tolerance: tests/ft."""

from __future__ import annotations

import numpy as np
import pytest
from strategy_helpers import make_case, reference_run, sampled_steps

from mpidist.parallel import ShardedOptimizer, ShardingConfiguration
from mpidist.parallel.recovery import PHASES, decide, lost_words
from mpidist.parallel.redundancy import copy_bytes_per_step, copy_stride, holder_of

STEPS, BATCH = 4, 12


def _train(comm, level, redundancy, *, steps=STEPS, kind="gpt", check=None, refresh="replay"):
    make_model, data, loss, make_opt = make_case(kind)
    opt = ShardedOptimizer(make_opt(), ShardingConfiguration(dtype="float64"), level=level,
                           loss=loss, comm=comm, redundancy=redundancy)
    model = opt.wrap(make_model(), seed=0)
    if opt.redundancy is not None:
        opt.redundancy.refresh = refresh
    return opt, sampled_steps(opt, model, data, steps, BATCH, check)


def _neighbour_truth(opt):
    """The live (parameter shard, state shards, step) of this rank's neighbour, sent here."""
    red, model = opt.redundancy, opt.model
    mine = np.empty(red.layout.local_size, dtype=model.dtype)
    red._own_params(model, mine)  # noqa: SLF001 - the test reads the same shard the copy has
    parts = [mine] + [opt.state.buffers[k] for k in sorted(opt.state.buffers)]
    send = np.concatenate(parts + [np.array([opt.state.step], dtype=model.dtype)])
    recv = np.empty_like(send)
    model.comm.Sendrecv(send, dest=red.holder, recvbuf=recv,
                        source=red.neighbour)
    return recv


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("refresh", ["replay", "send"])
@pytest.mark.parametrize("level", [1, 2, 3])
def test_the_copy_is_the_neighbours_state_after_every_step(level, refresh):
    from mpi4py import MPI

    seen = []

    def check(opt):
        red = opt.redundancy
        tag = opt.step_count + 1
        copy = red.copy_at(tag)
        assert copy is not None, (tag, red.copy_tag)
        params, state, step = copy
        got = np.concatenate([params] + [state[k] for k in sorted(state)]
                             + [np.array([step], dtype=params.dtype)])
        np.testing.assert_array_equal(got, _neighbour_truth(opt))
        assert red.copy_at(tag - 1) is not None or tag == 2  # the previous one kept
        seen.append(tag)

    _, with_copies = _train(MPI.COMM_WORLD, level, "buddy", check=check, refresh=refresh)
    _, without = _train(MPI.COMM_WORLD, level, "none")
    np.testing.assert_array_equal(with_copies, without)
    ref, _ = reference_run("gpt", STEPS, BATCH, "float64")
    np.testing.assert_allclose(with_copies, ref, rtol=0, atol=1e-9)
    assert seen == list(range(2, STEPS + 2))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_the_snapshot_is_the_start_of_the_step_and_memory_is_reported(level):
    from mpi4py import MPI

    starts = []

    def check(opt):
        red = opt.redundancy
        assert red.snap_tag == opt.step_count
        starts.append((red.snap_params.copy(), {k: v.copy() for k, v in
                                                red.snap_state.items()}, red.snap_step))

    opt, _ = _train(MPI.COMM_WORLD, level, "buddy", steps=3, check=check)
    # the snapshot of step s is the state after step s - 1, which the next one's start is
    red = opt.redundancy
    params, state, step, _ = red.own_at(opt.model, opt.state, {}, opt.step_count + 1)
    assert step == opt.state.step
    assert starts[-1][2] == step - 1
    report = opt.memory_report()
    assert report["redundancy"] == red.nbytes() > 0
    n, local = opt.model.dp_size, opt.model.layout.local_size
    k = len(opt.state.buffers)
    item = np.dtype(opt.model.dtype).itemsize
    if level == 0:
        assert red.nbytes() == (1 + k) * opt.model.layout.full_size * item
    else:
        grads = local if level >= 2 else 0
        assert red.nbytes() == (3 * (1 + k) * local + grads) * item
    assert red.bytes_per_step() == copy_bytes_per_step(level, local, item)
    assert n == MPI.COMM_WORLD.Get_size()


def test_copy_bytes_per_step_formula():
    assert copy_bytes_per_step(0, 100, 8) == 0
    assert copy_bytes_per_step(1, 100, 8) == 0
    assert copy_bytes_per_step(2, 100, 8) == 800
    assert copy_bytes_per_step(3, 100, 4) == 400
    assert [holder_of(r, 4) for r in range(4)] == [1, 2, 3, 0]


def test_copy_stride_puts_every_copy_on_another_node():
    assert copy_stride([0, 0, 0, 0]) == 1  # one node: the next rank
    assert copy_stride([0, 0, 1, 1]) == 2  # node by node, 2 per node: the next node
    assert [holder_of(r, 4, 2) for r in range(4)] == [2, 3, 0, 1]
    assert copy_stride([0, 1, 0, 1]) == 1  # round robin: the next rank is on the next node
    assert copy_stride([0, 0, 0, 1, 1, 1]) == 3
    assert copy_stride([0, 0, 0, 1]) == 1  # no ring step separates them all: the default
    assert copy_stride([5]) == 1
    # a node lost whole (ranks 2 and 3 of [0, 0, 1, 1]): both copies are on node 0
    values = _table([[4, 5, 5, -1], [4, 5, 5, -1]])
    d = decide(4, [0, 1], values, copies=True, stride=2)
    assert not d.unrecoverable and d.holders == {2: 0, 3: 1}
    d = decide(4, [0, 2], values, copies=True, stride=2)  # rank 1 and its holder 3
    assert "rank 1 and rank 3, which held its copy, died together" in d.unrecoverable


def _table(rows, phase=0):
    """(completed, phase, snapshot, copies...) rows from (completed, snapshot, copies...)."""
    return np.array([[r[0], phase, *r[1:]] for r in rows], dtype=np.int64)


def test_decide_goes_on_from_the_smallest_completed_step():
    # 4 ranks, rank 2 died in step 6; rank 0 had finished step 6, the others had not
    values = _table([[6, 6, 6, 7], [5, 6, 5, 6], [5, 6, 6, 5]])
    d = decide(4, [0, 1, 3], values, copies=True)
    assert (d.step, d.dead, d.unrecoverable, d.holders) == (5, [2], "", {2: 3})


def test_decide_ends_the_job_when_a_copy_is_gone():
    values = _table([[5, 6, 6, 5], [5, 6, 5, 6]], phase=PHASES.index("backward"))
    d = decide(4, [0, 1], values, copies=True, world=[0, 1, 2, 3])
    assert d.dead == [2, 3]
    assert "rank 2 and rank 3, which held its copy, died together" in d.unrecoverable
    assert "lost ranks 2 and 3 in step 6 (backward)" in d.unrecoverable
    assert "\n" not in d.unrecoverable
    # the holder is alive but its copy is of another step
    values = _table([[5, 6, 6, 5], [5, 6, 5, 6], [5, 6, 4, 3]])
    d = decide(4, [0, 1, 3], values, copies=True)
    assert "the copy of rank 2 was not yet refreshed for step 6" in d.unrecoverable
    # DDP keeps no copies: every survivor has everything
    d = decide(4, [0], _table([[5, 6, -1, -1]]), copies=False)
    assert d.unrecoverable == "" and d.dead == [1, 2, 3]
    d = decide(4, [0, 1, 3], values, copies=True, off="--redundancy none keeps no copies")
    assert "in-job recovery is off (--redundancy none keeps no copies)" in d.unrecoverable
    assert lost_words([3]) == "rank 3" and lost_words([1, 2, 5]) == "ranks 1, 2 and 5"


def test_bad_redundancy_is_one_line():
    from mpidist.optim import SGD

    with pytest.raises(ValueError, match="redundancy='mirror' is not one of"):
        ShardedOptimizer(SGD(lr=0.1), redundancy="mirror")
