"""The pure rules of growing back after in-job recovery (mpidist.parallel.regrow)."""

from __future__ import annotations

import pytest

from mpidist.parallel.regrow import MAX_TRIES, joins_wanted, next_try
from mpidist.run.config import TrainConfig


def test_grows_back_to_the_starting_size():
    assert joins_wanted(3, 4, 0, step=3, steps=6) == 1
    assert joins_wanted(2, 4, 0, step=3, steps=6) == 2
    assert joins_wanted(4, 4, 0, step=3, steps=6) == 0


def test_a_target_caps_the_growth_and_never_raises_it():
    assert joins_wanted(2, 4, 3, step=3, steps=6) == 1
    assert joins_wanted(3, 4, 3, step=3, steps=6) == 0
    assert joins_wanted(3, 4, 1, step=3, steps=6) == 0
    assert joins_wanted(3, 4, 8, step=3, steps=6) == 1  # not above the starting size


def test_never_after_the_last_step():
    assert joins_wanted(3, 4, 0, step=6, steps=6) == 0
    assert joins_wanted(3, 4, 0, step=5, steps=6) == 1


def test_a_failed_join_backs_off_and_gives_up():
    assert next_try(3, 1) == 5
    assert next_try(5, 2) == 9
    assert joins_wanted(3, 4, 0, step=4, steps=20, failures=1, retry_at=5) == 0
    assert joins_wanted(3, 4, 0, step=5, steps=20, failures=1, retry_at=5) == 1
    assert joins_wanted(3, 4, 0, step=19, steps=20, failures=MAX_TRIES, retry_at=0) == 0


def test_the_flag_is_checked():
    assert TrainConfig().regrow == "spawn"
    assert TrainConfig(regrow="none").regrow == "none"
    with pytest.raises(ValueError, match="regrow='grow' must be one of"):
        TrainConfig(regrow="grow")
