"""Admission under an async ratio: how many new groups may start without any becoming too stale.

A group started at policy version v is trained on at some version <= v + async_ratio only if no
more than (async_ratio + v + 1) x groups_per_step groups have been started in total by then: the
trainer consumes groups_per_step per version. So the controller hands out at most

    (async_ratio + version + 1) * groups_per_step - (finished + in_flight)

slots (AReaL's bound). async_ratio 0 is synchronous on-policy training.
"""

from __future__ import annotations


def admission_capacity(async_ratio: int, version: int, groups_per_step: int, finished: int, in_flight: int) -> int:
    if async_ratio < 0:
        raise ValueError(f"async_ratio: must be >= 0, got {async_ratio}")
    if groups_per_step < 1:
        raise ValueError(f"groups_per_step: must be >= 1, got {groups_per_step}")
    return max(0, (async_ratio + version + 1) * groups_per_step - (finished + in_flight))


def group_is_stale(finished_start_versions: list[int], version: int, async_ratio: int) -> bool:
    """True once a group still being rolled out can never be trained on.

    A group's version is the smallest start version of its members; the trainer at version v takes
    only groups whose version is >= v - async_ratio. While members are still running, only the
    finished members' start versions are known: the group's version is at most their minimum, so
    a True here is never wrong (the group is doomed and its remaining generations are waste).
    """
    return bool(finished_start_versions) and version - min(finished_start_versions) > async_ratio
