"""In-process backend: the embedded default and the reference the Redis backend is tested against."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import Counter, defaultdict

from sample_buffer.buffer import COUNTERS, SampleBuffer, by_domain
from sample_buffer.codec import GroupHeader
from sample_buffer.config import BufferConfig
from sample_buffer.deadlines import wait_for


class MemoryBuffer(SampleBuffer):
    def __init__(self, config: BufferConfig) -> None:
        super().__init__(config)
        self._seq = itertools.count()
        self._entries: dict[int, tuple[int, bytes, str]] = {}  # seq -> (start_version, data, domain)
        # per domain, a heap of seqs: oldest first, redelivered ones regain their place
        self._ready: defaultdict[str, list[int]] = defaultdict(list)
        self._batches: dict[str, tuple[float, list[int]]] = {}  # batch_id -> (handed out at, seqs)
        self._counters: Counter[str] = Counter()
        self._arrived = asyncio.Event()

    async def _append(self, items: list[tuple[GroupHeader, bytes]]) -> int:
        stored = 0
        for header, data in items:
            if len(self._entries) >= self.config.capacity_groups:
                break
            seq = next(self._seq)
            self._entries[seq] = (header.start_version, data, self._queue(header.domain))
            heapq.heappush(self._ready[self._queue(header.domain)], seq)
            stored += 1
        self._counters["put"] += stored
        if stored:
            self._arrived.set()
        return stored

    def _redeliver_expired(self, every: bool = False) -> int:
        now, back = time.monotonic(), 0
        for batch_id, (t0, seqs) in list(self._batches.items()):
            if every or now - t0 >= self.config.visibility_timeout_s:
                del self._batches[batch_id]
                for s in seqs:
                    heapq.heappush(self._ready[self._entries[s][2]], s)
                back += len(seqs)
        self._counters["redelivered"] += back  # (Redis counts them as they are handed out again)
        if back:
            self._arrived.set()
        return back

    async def _requeue(self) -> int:
        return self._redeliver_expired(every=True)

    def _until_next_expiry(self) -> float:
        if not self._batches:
            return float("inf")
        oldest = min(t0 for t0, _ in self._batches.values())
        return max(0.0, oldest + self.config.visibility_timeout_s - time.monotonic())

    async def _take(
        self, batch_id: str, k: int, floor: int, wait_s: float, domain: str = ""
    ) -> tuple[list[bytes], int]:
        self._redeliver_expired()
        ready = self._ready[domain]
        if not ready and wait_s > 0:
            self._arrived.clear()
            try:
                await wait_for(self._arrived.wait(), timeout=min(wait_s, self._until_next_expiry()))
            except TimeoutError:
                pass
            self._redeliver_expired()
        out, seqs, stale = [], [], 0
        while ready and len(out) < k:
            seq = heapq.heappop(ready)
            version, data, _ = self._entries[seq]
            if version < floor:
                del self._entries[seq]
                stale += 1
                continue
            out.append(data)
            seqs.append(seq)
        if seqs:
            t0, held = self._batches.get(batch_id, (time.monotonic(), []))
            self._batches[batch_id] = (t0, held + seqs)
        self._counters["dropped_stale"] += stale
        return out, stale

    async def _handed_out(self, batch_id: str) -> None:
        if batch_id in self._batches:  # (a requeue meanwhile took it back)
            self._batches[batch_id] = (time.monotonic(), self._batches[batch_id][1])

    def _queue(self, domain: str) -> str:
        """Batches by domain keep a queue per domain; otherwise every group is in one."""
        return domain if self.domains else ""

    async def _ack(self, batch_id: str) -> int:
        _, seqs = self._batches.pop(batch_id, (0.0, []))
        for s in seqs:
            del self._entries[s]
        self._counters["consumed"] += len(seqs)
        return len(seqs)

    async def _forget(self, batch_id: str) -> None:
        self._batches.pop(batch_id, None)

    async def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] += n

    async def _stats(self) -> dict:
        in_flight = sum(len(s) for _, s in self._batches.values())
        return (
            {"depth": len(self._entries) - in_flight, "in_flight": in_flight}
            | {c: self._counters[c] for c in COUNTERS}
            | {"by_domain": by_domain(self._counters, {d: len(self._ready[d]) for d in self.domains})}
        )
