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
