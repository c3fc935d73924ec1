import pytest

from rollout.admission import admission_capacity, group_is_stale


def test_capacity_is_the_staleness_bound():
    # async_ratio 1, 4 groups per step: 8 groups may start before the first update.
    assert admission_capacity(1, 0, 4, finished=0, in_flight=0) == 8
    assert admission_capacity(1, 0, 4, finished=3, in_flight=5) == 0
    assert admission_capacity(1, 1, 4, finished=4, in_flight=4) == 4  # one step consumed one batch
    assert admission_capacity(0, 0, 4, finished=0, in_flight=4) == 0  # on-policy: one batch at a time
    assert admission_capacity(2, 3, 2, finished=1, in_flight=1) == 10
    assert admission_capacity(1, 0, 4, finished=9, in_flight=0) == 0  # never negative


def test_bad_parameters():
    with pytest.raises(ValueError, match="async_ratio"):
        admission_capacity(-1, 0, 4, 0, 0)
    with pytest.raises(ValueError, match="groups_per_step"):
        admission_capacity(1, 0, 0, 0, 0)


def test_a_group_is_stale_once_a_finished_member_is_older_than_the_bound():
    assert not group_is_stale([], version=9, async_ratio=0)  # nothing finished: unknown, keep it
    assert not group_is_stale([3, 4], version=5, async_ratio=2)  # trained at v5 if put now
    assert group_is_stale([3, 4], version=6, async_ratio=2)  # v6 takes versions >= 4 only
    assert group_is_stale([5], version=6, async_ratio=0)
