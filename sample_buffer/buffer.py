"""The SampleBuffer's behaviour, shared by its backends.

Every group ends in exactly one state, each with a counter: ``consumed`` (handed out and
acked), ``dropped_stale`` (too old to train on when its turn came), ``dropped_filtered``
(no learning signal), ``dropped_capacity`` (the buffer stayed full for the whole put timeout)
and, for bytes that cannot be read back, ``dropped_corrupt``. Backends implement five
primitives; the freshness rule, the blocking and the accounting live here once.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field

from sample_buffer.codec import CodecError, GroupHeader, decode_group, encode_group, read_header
from sample_buffer.config import BufferConfig
from sample_buffer.domains import WeightedTurns
from sample_buffer.filters import GroupFilter, zero_variance
from sample_buffer.trajectory import Group, PutRefusal

COUNTERS = (
    "put",
    "consumed",
    "dropped_stale",
    "dropped_filtered",
    "dropped_capacity",
    "dropped_corrupt",
    "redelivered",
)


DOMAIN_POLL_S = 0.25  # a batch waiting on several domains looks at each again this often


class BufferFull(TimeoutError):
    """The buffer stayed at capacity for the whole put timeout; the group was not stored."""


class UnknownDomain(CodecError):
    """A group of a domain this buffer does not assemble batches of (``buffer.domain_weights``)."""


class BufferBackendError(RuntimeError):
    """The backend cannot serve (e.g. a Redis key of the wrong type); the message says which."""


@dataclass
class Batch:
    batch_id: str  # "" when nothing was handed out
    groups: list[bytes] = field(default_factory=list)  # encoded groups, oldest first
    # Groups dropped as too stale while filling this batch. They will never be trained on, so the
    # consumer hands their admission slots back (or staleness drops would shrink the async budget).
    dropped_stale: int = 0

    def decode(self) -> list[Group]:
        return [decode_group(g) for g in self.groups]


@dataclass
class PutResult:
    accepted: bool
    reason: str = ""  # a PutRefusal's value when not accepted


def _check_all(datas: list[bytes]) -> None:
    """Decode each payload to check it, keeping none: a call's groups are never all inflated at once."""
    for d in datas:
        decode_group(d)


DOMAIN_COUNTERS = ("handed_out", "substituted", "dropped_filtered")  # kept per domain as "<name>:<domain>"


def by_domain(counters: dict[str, int], depths: dict[str, int]) -> dict[str, dict[str, int]]:
    """Each domain's depth (waiting, not handed out) and its ``DOMAIN_COUNTERS``."""
    return {d: {"depth": n} | {c: int(counters.get(f"{c}:{d}", 0)) for c in DOMAIN_COUNTERS} for d, n in depths.items()}


def min_version(version: int, max_staleness: int) -> int:
    """Oldest ``start_version`` still fresh enough: a group may lag ``max_staleness`` versions."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness: must be >= 0, got {max_staleness}")
    return version - max_staleness


class SampleBuffer(ABC):
    def __init__(self, config: BufferConfig) -> None:
        self.config = config
        self.filters: list[GroupFilter] = [zero_variance] if config.filter_zero_variance else []
        # Batches by domain (docs/domains.md): each slot of a batch is drawn by weighted turns, so every
        # batch holds each domain's share to within two groups, the run's total to within one.
        self.domains = [d for d, w in config.domain_weights.items() if w > 0]
        weights = {d: config.domain_weights[d] for d in self.domains}
        self._turns = WeightedTurns(weights) if weights else None
        self._gift_turns = WeightedTurns(weights) if weights else None  # who fills a domain's slots for it
        self._waited: dict[str, float] = {}  # by domain: seconds batches waited for it since it last gave one

    # ------------------------------------------------------------------ API
    async def put(self, group: Group | bytes, timeout_s: float | None = None) -> PutResult:
        """Store a complete group; waits while the buffer is full, ``BufferFull`` after the timeout."""
        [result] = await self.put_many([group], timeout_s)
        if result.reason == PutRefusal.FULL:
            raise BufferFull(f"buffer full ({self.config.capacity_groups} groups) for the whole put timeout")
        return result

    async def put_many(self, groups: list[Group | bytes], timeout_s: float | None = None) -> list[PutResult]:
        """Store several groups in one backend round trip, in order. Every payload is decoded and
        validated before any is stored (``CodecError`` stores nothing): a group is checked here, where
        it enters the buffer, and never again (the trainer decodes without checks); filtered groups are counted and
        skipped; groups still without room at the timeout come back as not accepted with reason
        ``full`` (counted as ``dropped_capacity``), the earlier ones of the call stored: each caller
        learns what became of its own group."""
        datas = [encode_group(g) if isinstance(g, Group) else bytes(g) for g in groups]
        # A Group object was checked when it was built; bytes are checked here, off the event loop (a
        # large put decodes for a while, and the buffer goes on serving the other calls meanwhile).
        received = [d for g, d in zip(groups, datas, strict=True) if not isinstance(g, Group)]
        if received:
            await asyncio.to_thread(_check_all, received)
        headers = [read_header(d) for d in datas]
        for h in headers:  # before any is stored: a refused call stores nothing
            if self._turns is not None and h.domain not in self.domains:
                raise UnknownDomain(f"domain: {h.domain!r} (group {h.group_id!r}) is not one of {self.domains}")
        results = [PutResult(True) for _ in datas]
        todo = []
        for i, h in enumerate(headers):
            for f in self.filters:
                if reason := f(h):
                    results[i] = PutResult(False, reason)
                    await self._count(f"dropped_{reason}")
                    if h.domain:
                        await self._count(f"dropped_{reason}:{h.domain}")
                    break
            else:
                todo.append(i)
        timeout = self.config.put_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        delay = 0.005
        while todo:
            stored = await self._append([(headers[i], datas[i]) for i in todo])
            todo = todo[stored:]
            if not todo:
                break
            if time.monotonic() >= deadline:
                await self._count("dropped_capacity", len(todo))
                for i in todo:
                    results[i] = PutResult(False, PutRefusal.FULL)
                break
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.1)
        return results

    async def get(self, num_groups: int, version: int, max_staleness: int, timeout_s: float) -> Batch:
        """Up to ``num_groups`` fresh groups, oldest first; waits up to ``timeout_s`` for a full batch
        and returns what it has then (possibly nothing, with an empty ``batch_id``)."""
        if num_groups < 1:
            raise ValueError(f"num_groups: must be >= 1, got {num_groups}")
        if not math.isfinite(timeout_s):  # NaN was read as 0, infinity as forever (a negative one waits none)
            raise ValueError(f"timeout_s: must be a finite number, got {timeout_s}")
        floor = min_version(version, max_staleness)
        batch_id = uuid.uuid4().hex
        deadline = time.monotonic() + max(0.0, timeout_s)
        got: list[bytes] = []
        stale = 0
        if self._turns is not None:
            got, stale = await self._get_by_domain(batch_id, num_groups, floor, deadline)
        while self._turns is None:
            wait = max(0.0, deadline - time.monotonic())
            fresh, dropped = await self._take(batch_id, num_groups - len(got), floor, wait)
            if fresh and not got:
                deadline = self._hold_limit(deadline)
            got, stale = got + fresh, stale + dropped
            if len(got) >= num_groups or time.monotonic() >= deadline:
                break
        if not got:
            await self._forget(batch_id)
        else:
            await self._handed_out(batch_id)  # the visibility timeout counts from now
        return Batch(batch_id if got else "", got, stale)

    def _hold_limit(self, deadline: float) -> float:
        """The deadline once a batch holds its first group: groups taken early wait in the batch while it
        fills, never so long that their visibility timeout could hand them out again (the trainer asks
        again for what is missing)."""
        return min(deadline, time.monotonic() + self.config.visibility_timeout_s / 2)

    async def _get_by_domain(
        self, batch_id: str, num_groups: int, floor: int, deadline: float
    ) -> tuple[list[bytes], int]:
        """A batch whose slots are drawn by domain weight. A domain that batches have waited for
        ``domain_wait_s`` in all since it last gave a group hands its slots to the others by their weights
        (counted once, ``substituted:<domain>``; it is owed one slot at most afterwards), at once in the
        batches after, until it gives one again; a domain's own slots unfilled at the deadline are given
        back to the turns, so the next batch owes them."""
        turns, gifts = self._turns, self._gift_turns
        assert turns is not None and gifts is not None
        own = Counter(turns.draw() for _ in range(num_groups))  # slots of each domain's own turns
        gift: Counter[str] = Counter()  # slots another domain could not fill, given to this one
        got: list[bytes] = []
        stale = 0
        empty_since: dict[str, float] = {}

        def short() -> list[str]:
            return [d for d in self.domains if own[d] + gift[d] > 0]

        async def take(d: str, wait_s: float) -> None:
            nonlocal got, stale, deadline
            fresh, dropped = await self._take(batch_id, own[d] + gift[d], floor, wait_s, d)
            if fresh and not got:
                deadline = self._hold_limit(deadline)
            got, stale = got + fresh, stale + dropped
            mine = min(len(fresh), own[d])
            own[d], gift[d] = own[d] - mine, gift[d] - (len(fresh) - mine)
            if fresh:
                empty_since.pop(d, None)
                self._waited.pop(d, None)
                await self._count(f"handed_out:{d}", len(fresh))
            else:
                empty_since.setdefault(d, time.monotonic())

        try:
            while True:
                for d in short():
                    await take(d, 0.0)
                now = time.monotonic()
                if not short() or now >= deadline:
                    break
                waited = {d: self._waited.get(d, 0.0) + now - empty_since.get(d, now) for d in self.domains}
                overdue = [d for d in short() if waited[d] >= self.config.domain_wait_s]
                takers = {d for d in self.domains if waited[d] < self.config.domain_wait_s}
                if overdue and takers:
                    for d in overdue:
                        slots, mine = own[d] + gift[d], own[d]
                        for _ in range(mine):
                            turns.refund(d)
                        own[d] = gift[d] = 0
                        for _ in range(slots):
                            gift[gifts.draw(among=takers)] += 1
                        await self._count(f"substituted:{d}", mine)
                    continue
                # Wait for the first short domain's next group (any arrival wakes the in-memory backend;
                # Redis polls): a little at a time, so the others are looked at again soon.
                await take(short()[0], min(deadline - now, DOMAIN_POLL_S))
        finally:  # a domain's own slots left unfilled (the deadline, a failure): owed to the next batch
            for d in self.domains:
                for _ in range(own[d]):
                    turns.undo(d)
            now = time.monotonic()
            for d, t0 in empty_since.items():  # a dead domain is waited for once, not in every batch
                self._waited[d] = self._waited.get(d, 0.0) + now - t0
        return got, stale

    async def ack(self, batch_id: str) -> int:
        """Mark a batch consumed; returns how many groups this ack consumed (0 if already acked or
        if the batch timed out and its groups went to another batch)."""
        if not batch_id:
            raise ValueError("batch_id: must not be empty")
        return await self._ack(batch_id)

    async def requeue(self) -> int:
        """Every batch handed out and not acked goes back to the queue now, ahead of newer groups: its
        consumer is gone, and no get may be in flight. The run's one consumer, a trainer, calls this as
        it starts; otherwise what its dead predecessor held came back only at the visibility timeout,
        and admission, which counts those groups as made, let nothing new be made meanwhile. Returns
        how many groups went back (each counted ``redelivered`` once, like a timed-out batch's)."""
        return await self._requeue()

    async def stats(self) -> dict:
        return await self._stats()

    async def close(self) -> None:
        return None

    # ------------------------------------------------------------------ backend primitives
    @abstractmethod
    async def _append(self, items: list[tuple[GroupHeader, bytes]]) -> int:
        """Store items in order until the buffer is full; return how many were stored. Counts ``put``."""

    @abstractmethod
    async def _take(
        self, batch_id: str, k: int, floor: int, wait_s: float, domain: str = ""
    ) -> tuple[list[bytes], int]:
        """Hand up to ``k`` groups of ``domain`` to ``batch_id``: first those whose batch passed the
        visibility timeout, then new ones; drop (and count) stale and corrupt ones on the way. May wait
        up to ``wait_s`` for the first group. Returns the groups and how many were dropped as stale."""

    @abstractmethod
    async def _handed_out(self, batch_id: str) -> None:
        """The batch is returned: its visibility timeout starts now (not when its first group was taken)."""

    @abstractmethod
    async def _ack(self, batch_id: str) -> int:
        """Remove the groups ``batch_id`` still holds; count them ``consumed``."""

    @abstractmethod
    async def _requeue(self) -> int:
        """Put every handed-out group back where it was in its queue; return how many."""

    @abstractmethod
    async def _forget(self, batch_id: str) -> None:
        """Drop any bookkeeping of a batch that got nothing."""

    @abstractmethod
    async def _count(self, name: str, n: int = 1) -> None: ...

    @abstractmethod
    async def _stats(self) -> dict:
        """``depth``, ``in_flight``, every counter of ``COUNTERS`` and, by domain, ``by_domain``."""
