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
from dataclasses import dataclass, field

from sample_buffer.codec import GroupHeader, decode_group, encode_group, read_header
from sample_buffer.config import BufferConfig
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


class BufferFull(TimeoutError):
    """The buffer stayed at capacity for the whole put timeout; the group was not stored."""


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


def min_version(version: int, max_staleness: int) -> int:
    """Oldest ``start_version`` still fresh enough: a group may lag ``max_staleness`` versions."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness: must be >= 0, got {max_staleness}")
    return version - max_staleness


class SampleBuffer(ABC):
    def __init__(self, config: BufferConfig) -> None:
        self.config = config
        self.filters: list[GroupFilter] = [zero_variance] if config.filter_zero_variance else []

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
        results = [PutResult(True) for _ in datas]
        todo = []
        for i, h in enumerate(headers):
            for f in self.filters:
                if reason := f(h):
                    results[i] = PutResult(False, reason)
                    await self._count(f"dropped_{reason}")
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
        while True:
            wait = max(0.0, deadline - time.monotonic())
            fresh, dropped = await self._take(batch_id, num_groups - len(got), floor, wait)
            got, stale = got + fresh, stale + dropped
            if len(got) >= num_groups or time.monotonic() >= deadline:
                break
        if not got:
            await self._forget(batch_id)
        return Batch(batch_id if got else "", got, stale)

    async def ack(self, batch_id: str) -> int:
        """Mark a batch consumed; returns how many groups this ack consumed (0 if already acked or
        if the batch timed out and its groups went to another batch)."""
        if not batch_id:
            raise ValueError("batch_id: must not be empty")
        return await self._ack(batch_id)

    async def stats(self) -> dict:
        return await self._stats()

    async def close(self) -> None:
        return None

    # ------------------------------------------------------------------ backend primitives
    @abstractmethod
    async def _append(self, items: list[tuple[GroupHeader, bytes]]) -> int:
        """Store items in order until the buffer is full; return how many were stored. Counts ``put``."""

    @abstractmethod
    async def _take(self, batch_id: str, k: int, floor: int, wait_s: float) -> tuple[list[bytes], int]:
        """Hand up to ``k`` groups to ``batch_id``: first those whose batch passed the visibility
        timeout, then new ones; drop (and count) stale and corrupt ones on the way. May wait up to
        ``wait_s`` for the first group. Returns the groups and how many were dropped as stale."""

    @abstractmethod
    async def _ack(self, batch_id: str) -> int:
        """Remove the groups ``batch_id`` still holds; count them ``consumed``."""

    @abstractmethod
    async def _forget(self, batch_id: str) -> None:
        """Drop any bookkeeping of a batch that got nothing."""

    @abstractmethod
    async def _count(self, name: str, n: int = 1) -> None: ...

    @abstractmethod
    async def _stats(self) -> dict:
        """``depth``, ``in_flight`` and every counter of ``COUNTERS``."""
