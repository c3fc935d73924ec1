"""Scheduling strategies: how many groups the rollout loop admits at once, and when.

A strategy is a plain object with ``run(groups, num_workers)``; it asks ``groups.admit`` for slots
and hands them to ``groups.run_admitted``, until ``groups.running`` turns false. ``Groups`` is the
rollout loop as a strategy sees it: the calls below, nothing else.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from typing import TYPE_CHECKING, Protocol

from rollout.domains import Pick
from rollout.ports import GroupOutcome
from rollout.turn_barrier import TurnBarrier

if TYPE_CHECKING:
    from rollout.config import RolloutConfig, TailBatchingConfig


class Groups(Protocol):
    """The rollout loop, as a scheduling strategy drives it."""

    running: bool  # false once the loop stops admitting
    config: RolloutConfig
    counters: Counter[str]  # the loop's event counts; strategies add their own

    async def admit(self, num_groups: int) -> int:
        """Slots granted now (0 when refused)."""

    async def run_admitted(
        self, num_groups: int, barrier: TurnBarrier | None = None, rows: list[Pick] | None = None
    ) -> list[GroupOutcome]:
        """Run admitted groups together and hand their slots back."""

    def next_row(self) -> Pick:
        """The next prompt: its domain and row."""

    def members(self, pick: Pick) -> int:
        """Episodes a group of this prompt runs."""

    async def run_group_safely(
        self, barrier: TurnBarrier | None = None, row: Pick | None = None, seats: Seats | None = None
    ) -> GroupOutcome:
        """One group, start to end; never raises (a failure is an outcome)."""

    async def abort_groups(self, rows: set[Pick]) -> None:
        """Abort the generations of these rows' groups at the engines."""

    async def release(self, unused: int = 0, finished: int = 0) -> None:
        """Hand admitted slots back to the controller."""


class Scheduling(Protocol):
    workers: int  # concurrent workers while running

    async def run(self, loop: Groups, num_workers: int) -> None: ...


class QueueScheduling:
    """Each of ``num_workers`` workers owns one group at a time and asks for the next prompt the
    moment its group is in the buffer: nothing waits for a batch."""

    def __init__(self) -> None:
        self.workers = 0

    async def run(self, loop: Groups, num_workers: int) -> None:
        self.workers = num_workers
        await asyncio.gather(*(self._worker(loop) for _ in range(num_workers)))

    async def _worker(self, loop: Groups) -> None:
        failures = 0  # in a row: back off so a broken dependency is not hammered with new groups
        while loop.running:
            if not await loop.admit(1):
                continue
            [outcome] = await loop.run_admitted(1)
            failures = failures + 1 if outcome == GroupOutcome.FAILED else 0
            if failures:
                await asyncio.sleep(min(5.0, 0.1 * 2**failures))


class BatchScheduling:
    """The synchronous baseline ``rollmesh bench async`` measures against: admit as many groups as
    allowed (up to ``num_workers``), generate every response, then score them all (a
    ``TurnBarrier`` per turn), then put them all, then admit the next batch."""

    def __init__(self) -> None:
        self.workers = 0

    async def run(self, loop: Groups, num_workers: int) -> None:
        self.workers = 1
        while loop.running:
            n = await loop.admit(num_workers)
            if n:
                picks = [loop.next_row() for _ in range(n)]
                parties = sum(loop.members(p) for p in picks)  # every episode is a party
                await loop.run_admitted(n, TurnBarrier(parties), rows=picks)


class Seats:
    """A round's quota of groups to put. A group that ends takes a seat before it is put and keeps
    it if the buffer accepts it; a filtered (or failed) put gives it back. While every free seat
    is taken by puts under way, a group that ends waits for their outcome: the round is full only
    once ``n`` groups are in."""

    def __init__(self, n: int) -> None:
        self.free, self.pending = n, 0
        self._changed = asyncio.Condition()

    async def take(self) -> bool:
        """A seat (True), or False once the quota is in."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.free > 0 or self.pending == 0)
            if self.free <= 0:
                return False
            self.free, self.pending = self.free - 1, self.pending + 1
            return True

    async def done(self, accepted: bool) -> None:
        async with self._changed:
            self.pending -= 1
            self.free += 0 if accepted else 1
            self._changed.notify_all()


class TailScheduling:
    """RollPacker's tail batching, for synchronous training (``async_ratio`` 0).

    A short round admits a step's groups (the quota) but launches ``redundant_prompts`` more
    prompts, and ends the moment the quota of groups is in the buffer: the prompts still
    generating then are the long tail. They are aborted and queued; once the queue holds a step's
    worth, a long round runs them together, every group to its end. Both rounds feed training, so
    long-answer prompts are trained on, a few steps later, not dropped; and most steps no longer
    wait for the slowest answer of the step.
    """

    def __init__(self, config: TailBatchingConfig) -> None:
        self.config = config
        self.workers = 0
        self.long_queue: deque[Pick] = deque()  # prompts waiting for a long round

    async def run(self, loop: Groups, num_workers: int) -> None:
        self.workers = 1
        while loop.running:
            n = await loop.admit(num_workers)
            if not n:
                continue
            if len(self.long_queue) >= n:
                loop.counters["tail_long_rounds"] += 1
                await loop.run_admitted(n, rows=[self.long_queue.popleft() for _ in range(n)])
            else:
                loop.counters["tail_short_rounds"] += 1
                await self._short_round(loop, n)

    async def _short_round(self, loop: Groups, n: int) -> None:
        seats = Seats(n)
        rows = [loop.next_row() for _ in range(n + self.config.redundant_prompts)]
        tasks = {asyncio.ensure_future(loop.run_group_safely(row=row, seats=seats)): row for row in rows}
        pending, put = set(tasks), 0
        try:
            while pending and put < n:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                put += sum(t.result() == GroupOutcome.PUT for t in done)
        except asyncio.CancelledError:  # the loop stops: every group goes, aborted at the engines
            await loop.abort_groups(set(rows))
            for t in tasks:
                t.cancel()
            await loop.release(unused=n - put, finished=put)
            raise
        if pending:  # the long tail: aborted now, run again in a long round
            tail = {tasks[t] for t in pending}
            await loop.abort_groups(tail)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self.long_queue.extend(tasks[t] for t in tasks if t in pending)
            loop.counters["tail_prompts_deferred"] += len(tail)
        await loop.release(unused=n - put, finished=put)


def make_scheduling(config: RolloutConfig) -> Scheduling:
    if config.scheduling == "tail":
        return TailScheduling(config.tail_batching)
    return {"queue": QueueScheduling, "batch": BatchScheduling}[config.scheduling]()
