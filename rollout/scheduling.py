"""Scheduling strategies: how many groups the rollout loop admits at once, and when.

A strategy is a plain object with ``run(loop, num_workers)``; it asks ``loop.admit`` for slots
and hands them to ``loop.run_admitted``, until ``loop.running`` turns false. Strategies still to
come plug in here: tail batching (RollPacker), redundant rollout (ROLL Flash).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from rollout.turn_barrier import TurnBarrier

if TYPE_CHECKING:
    from rollout.loop import RolloutLoop


class Scheduling(Protocol):
    workers: int  # concurrent workers while running

    async def run(self, loop: RolloutLoop, num_workers: int) -> None: ...


class QueueScheduling:
    """Each of ``num_workers`` workers owns one group at a time and asks for the next prompt the
    moment its group is in the buffer: nothing waits for a batch."""

    def __init__(self) -> None:
        self.workers = 0

    async def run(self, loop: RolloutLoop, num_workers: int) -> None:
        self.workers = num_workers
        await asyncio.gather(*(self._worker(loop) for _ in range(num_workers)))

    async def _worker(self, loop: RolloutLoop) -> None:
        failures = 0  # in a row: back off so a broken dependency is not hammered with new groups
        while loop.running:
            if not await loop.admit(1):
                continue
            [outcome] = await loop.run_admitted(1)
            failures = failures + 1 if outcome == "failed" else 0
            if failures:
                await asyncio.sleep(min(5.0, 0.1 * 2**failures))


class BatchScheduling:
    """The synchronous baseline ``rollmesh bench async`` measures against: admit as many groups as
    allowed (up to ``num_workers``), generate every response, then score them all (a
    ``TurnBarrier`` per turn), then put them all, then admit the next batch."""

    def __init__(self) -> None:
        self.workers = 0

    async def run(self, loop: RolloutLoop, num_workers: int) -> None:
        self.workers = 1
        while loop.running:
            n = await loop.admit(num_workers)
            if n:
                members = loop.config.group_size + loop.config.redundant_members  # every episode is a party
                await loop.run_admitted(n, TurnBarrier(n * members))


SCHEDULINGS: dict[str, type[Scheduling]] = {"queue": QueueScheduling, "batch": BatchScheduling}
