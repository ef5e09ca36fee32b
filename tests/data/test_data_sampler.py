"""GlobalBatchSampler: world-size invariance, epochs, micro-batches, exact resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpidist.data import GlobalBatchSampler, check_local_sizes, micro_batches, split_points

B = 24


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4, 5, 7, 24])
def test_local_slices_concatenate_to_the_global_batch(dp_size: int) -> None:
    s = GlobalBatchSampler(100, B, seed=7)
    assert s.steps_per_epoch == 4
    # Steps 3 -> 4 and 7 -> 8 cross epoch boundaries.
    for step in (0, 1, 3, 4, 5, 7, 8, 13):
        parts = [s.local_indices(step, r, dp_size) for r in range(dp_size)]
        # B // n each, one more on the first B % n ranks
        assert [len(p) for p in parts] == [B // dp_size + (r < B % dp_size)
                                           for r in range(dp_size)]
        np.testing.assert_array_equal(np.concatenate(parts), s.global_indices(step))


def test_split_points_differ_by_at_most_one() -> None:
    assert split_points(32, 3) == [0, 11, 22, 32]
    assert split_points(32, 5) == [0, 7, 14, 20, 26, 32]
    assert split_points(32, 7) == [0, 5, 10, 15, 20, 24, 28, 32]
    assert split_points(6, 6) == list(range(7))
    for n in range(1, 40):
        for parts in range(1, n + 1):
            sizes = np.diff(split_points(n, parts))
            assert sizes.sum() == n and sizes.max() - sizes.min() <= 1 and sizes.min() >= 1
    with pytest.raises(ValueError, match="5 items cannot be split into 6 non-empty parts"):
        split_points(5, 6)
    with pytest.raises(ValueError, match="parts=0"):
        split_points(5, 0)


def test_check_local_sizes_names_the_short_rank() -> None:
    check_local_sizes([11, 11, 10], 10)
    with pytest.raises(ValueError, match="data-parallel rank 2 has a local batch of 10 samples, "
                                         "fewer than micro_batches=11"):
        check_local_sizes([11, 11, 10], 11)


def test_global_batches_are_the_same_for_every_dp_size() -> None:
    ref = GlobalBatchSampler(100, B, seed=7)
    for dp_size in (1, 2, 3, 4):
        other = GlobalBatchSampler(100, B, seed=7)
        for step in range(10):
            got = np.concatenate(
                [other.local_indices(step, r, dp_size) for r in range(dp_size)]
            )
            np.testing.assert_array_equal(got, ref.global_indices(step))


def test_epochs_are_permutations_and_differ() -> None:
    s = GlobalBatchSampler(96, B, seed=1)
    e0 = np.concatenate([s.global_indices(k) for k in range(4)])
    e1 = np.concatenate([s.global_indices(k) for k in range(4, 8)])
    np.testing.assert_array_equal(np.sort(e0), np.arange(96))
    np.testing.assert_array_equal(np.sort(e1), np.arange(96))
    assert not np.array_equal(e0, e1)
    assert s.epoch_of(3) == 0 and s.epoch_of(4) == 1
    assert not np.array_equal(
        GlobalBatchSampler(96, B, seed=2).global_indices(0), s.global_indices(0)
    )
    np.testing.assert_array_equal(
        GlobalBatchSampler(96, B, seed=1, shuffle=False).global_indices(1), np.arange(24, 48)
    )


def test_drop_last_false_wraps_within_the_epoch() -> None:
    s = GlobalBatchSampler(50, B, seed=3, drop_last=False)
    assert s.steps_per_epoch == 3
    last = s.global_indices(2)
    assert len(last) == B
    perm = s.permutation(0)
    np.testing.assert_array_equal(last, np.concatenate([perm[48:], perm[:22]]))
    assert GlobalBatchSampler(50, B, seed=3).steps_per_epoch == 2


def test_dp_size_may_not_exceed_the_global_batch() -> None:
    s = GlobalBatchSampler(100, B)
    with pytest.raises(ValueError, match="B=24 is smaller than dp_size=25: every data-parallel "
                                         "rank needs at least one sample"):
        s.local_indices(0, 0, 25)
    with pytest.raises(ValueError, match="dp_rank=4 is outside"):
        s.local_indices(0, 4, 4)
    with pytest.raises(ValueError, match="dp_size=0"):
        s.local_indices(0, 0, 0)


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="n_samples=10 is smaller than global_batch_size=24"):
        GlobalBatchSampler(10, B)
    with pytest.raises(ValueError, match="global_batch_size=0"):
        GlobalBatchSampler(10, 0)
    with pytest.raises(ValueError, match="seed=-3"):
        GlobalBatchSampler(100, B, seed=-3)
    with pytest.raises(ValueError, match="step=-1"):
        GlobalBatchSampler(100, B).global_indices(-1)


def test_micro_batches() -> None:
    idx = np.arange(12)
    parts = micro_batches(idx, 3)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    np.testing.assert_array_equal(np.concatenate(GlobalBatchSampler.micro_batches(idx, 4)), idx)
    assert [p.tolist() for p in micro_batches(idx, 5)] == [[0, 1, 2], [3, 4, 5], [6, 7],
                                                          [8, 9], [10, 11]]
    with pytest.raises(ValueError, match="12 samples cannot be split into m=13 non-empty"):
        micro_batches(idx, 13)
    with pytest.raises(ValueError, match="m=0"):
        micro_batches(idx, 0)


def test_iteration_and_exact_resume() -> None:
    s = GlobalBatchSampler(100, B, seed=11)
    it = iter(s)
    first = [next(it) for _ in range(6)]  # crosses into epoch 1
    for k, batch in enumerate(first):
        np.testing.assert_array_equal(batch, s.global_indices(k))
    state = s.state_dict()
    assert state["step"] == 6 and state["epoch"] == 1 and state["samples_seen"] == 6 * B
    expected = [s.next_global() for _ in range(5)]

    resumed = GlobalBatchSampler(100, B, seed=11)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    got = [resumed.next_global() for _ in range(5)]
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a, b)

    # Resuming on a different number of ranks continues the same global sequence.
    other = GlobalBatchSampler(100, B, seed=11)
    other.load_state_dict(state)
    local = [other.local_indices(other.step, r, 3) for r in range(3)]
    np.testing.assert_array_equal(np.concatenate(local), expected[0])
    assert other.next_local(1, 3).tolist() == local[1].tolist()
    assert other.step == 7


def test_load_state_dict_rejects_another_run() -> None:
    state = GlobalBatchSampler(100, B, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 but this sampler has seed=2"):
        GlobalBatchSampler(100, B, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch_size=24 but this sampler has"):
        GlobalBatchSampler(100, 12, seed=1).load_state_dict(state)
    bad = {**state, "step": 5, "epoch": 0, "samples_seen": 5 * B}
    with pytest.raises(ValueError, match="epoch=0 is inconsistent with step=5"):
        GlobalBatchSampler(100, B, seed=1).load_state_dict(bad)
