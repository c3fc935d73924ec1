"""Admission under an async ratio: how many new groups may start without any becoming too stale.

A group started at policy version v is trained on at some version <= v + async_ratio only if no
more than (async_ratio + v + 1) x groups_per_step groups have been started in total by then: the
trainer consumes groups_per_step per version. So the controller hands out at most

    (async_ratio + version + 1) * groups_per_step - (finished + in_flight)

slots (AReaL's bound). async_ratio 0 is synchronous on-policy training.
"""

from __future__ import annotations

import asyncio

from sample_buffer.deadlines import wait_for


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


class RefusalGate:
    """While the controller refuses new groups, one worker asks again every ``admit_poll_s``; the
    others wait until it is granted, then all ask. Each worker polling on its own made
    ``num_workers`` x 20 refused Admit calls a second (the quickstart's 32: 640 a second, half a core
    for the controller and half for the EnvManager on a slow 2-core machine, while the trainer was
    starting). A waiter asks on its own after ``max_wait_s``: a poller that died holds no one for long."""

    def __init__(self, max_wait_s: float = 1.0) -> None:
        self.max_wait_s = max_wait_s
        self._poller: asyncio.Task | None = None
        self._open = asyncio.Event()
        self._open.set()

    async def wait_turn(self) -> None:
        """Before asking: wait while another worker polls a refusal."""
        poller = self._poller
        if poller is None or poller is asyncio.current_task():
            return
        if poller.done():
            self.open()
            return
        try:
            await wait_for(self._open.wait(), self.max_wait_s)
        except TimeoutError:
            pass

    def refused(self) -> None:
        """This worker was refused: it polls from now on, unless another does already."""
        if self._poller is None or self._poller.done():
            self._poller = asyncio.current_task()
            self._open.clear()

    def granted(self) -> None:
        """This worker got slots: if it was the poller, everyone may ask again."""
        if self._poller is asyncio.current_task():
            self.open()

    def open(self) -> None:
        self._poller = None
        self._open.set()
