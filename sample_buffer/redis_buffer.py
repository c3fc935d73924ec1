"""Redis backend: one Redis Stream per run, one consumer group, one consumer per batch.

Why a stream: XADD appends durably (AOF), XREADGROUP hands each entry to exactly one reader and
keeps it in the pending list until XACK, and XAUTOCLAIM moves entries whose reader went quiet
past the visibility timeout to a new reader. Naming the consumer after the batch makes a batch's
entries exactly "what that consumer still owns", so a late ack of a batch whose entries were
re-delivered acks nothing (the new batch owns them) and no group is consumed twice.

Keys (prefix per run, so runs share one Redis): ``{prefix}:groups`` (the stream; fields ``d``
encoded group, ``v`` start version) and ``{prefix}:stats`` (a hash of counters). Acked and
dropped entries are deleted from the stream, so its length is what the buffer holds and the
capacity check is one XLEN inside the same Lua script as the XADD (no check-then-act race). A
buffer that assembles batches by domain (``domain_weights``) keeps one stream per domain,
``{prefix}:groups:{domain}``; the capacity check then sums their lengths, in the same script.

Durability: run Redis with ``appendonly yes`` and ``appendfsync always`` (the tests and the
deploy configs do) so an acknowledged put survives ``kill -9``.
"""

from __future__ import annotations

import logging
import os

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, RedisError, ResponseError

from sample_buffer.buffer import COUNTERS, BufferBackendError, SampleBuffer, by_domain
from sample_buffer.codec import CodecError, GroupHeader, read_header
from sample_buffer.config import BufferConfig

log = logging.getLogger(__name__)
GROUP = b"trainers"
REQUEUED = b"requeued"  # the consumer a requeue gives a dead one's entries to, until XAUTOCLAIM hands them out

_APPEND = """
local held = 0
for i = 3, #KEYS do held = held + redis.call('XLEN', KEYS[i]) end
if held >= tonumber(ARGV[1]) then return false end
local id = redis.call('XADD', KEYS[1], '*', 'd', ARGV[2], 'v', ARGV[3])
redis.call('HINCRBY', KEYS[2], 'put', 1)
return id
"""


# Ack a batch in one round trip: whatever its consumer still owns is acked, deleted and counted.
_ACK = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', tonumber(ARGV[3]), ARGV[2])
local n = #pending
for i = 1, n, 1000 do
  local ids = {}
  for j = i, math.min(i + 999, n) do ids[#ids + 1] = pending[j][1] end
  redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
  redis.call('XDEL', KEYS[1], unpack(ids))
end
if n > 0 then redis.call('HINCRBY', KEYS[2], 'consumed', n) end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return n
"""


class RedisBuffer(SampleBuffer):
    def __init__(self, config: BufferConfig) -> None:
        super().__init__(config)
        self.stream = f"{config.key_prefix}:groups"
        self.stats_key = f"{config.key_prefix}:stats"
        # Batches by domain: a stream per domain (one consumer group each); otherwise the one stream.
        self.streams = {d: f"{self.stream}:{d}" for d in self.domains} or {"": self.stream}
        # rediss://: the certificate is verified (redis-py's default for rediss) and so is its host name.
        tls = (
            {"ssl_ca_certs": config.redis_ca_path, "ssl_check_hostname": True}
            if config.redis_url.startswith("rediss")
            else {}
        )
        self.redis = aioredis.from_url(
            config.redis_url,
            **tls,
            username=config.redis_username,
            password=os.environ.get(config.redis_password_env) or None,
            socket_timeout=config.redis_timeout_s,
            socket_connect_timeout=config.redis_timeout_s,
            decode_responses=False,
        )
        self._append_script = self.redis.register_script(_APPEND)
        self._ack_script = self.redis.register_script(_ACK)
        self._ready = False

    async def close(self) -> None:
        await self.redis.aclose()

    async def _ensure_group(self) -> None:
        if self._ready:
            return
        for stream in self.streams.values():
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise self._explain(e) from None
        self._ready = True

    def _explain(self, e: RedisError) -> BufferBackendError:
        if "WRONGTYPE" in str(e):
            return BufferBackendError(
                f"Redis key {self.stream!r} or {self.stats_key!r} exists with another type: is another program "
                f"using the key prefix {self.config.key_prefix!r}? ({e})"
            )
        if isinstance(e, AuthenticationError) or any(s in str(e) for s in ("NOAUTH", "WRONGPASS")):
            return BufferBackendError(
                f"Redis on {self.config.redis_url} refused the buffer ({e}): set its password in "
                f"${self.config.redis_password_env} (buffer.redis_password_env)"
            )
        return BufferBackendError(f"Redis error on {self.config.redis_url}: {type(e).__name__}: {e}")

    async def _append(self, items: list[tuple[GroupHeader, bytes]]) -> int:
        """One pipelined round trip; each script call re-checks capacity, so the stored ones are
        a prefix of ``items`` (a full buffer stays full within one pipeline: nobody acks in it)."""
        try:
            await self._ensure_group()
            pipe = self.redis.pipeline(transaction=False)
            for header, data in items:
                stream = self.streams[header.domain if self.domains else ""]
                await self._append_script(  # queued on the pipeline, not sent yet
                    keys=[stream, self.stats_key, *self.streams.values()],
                    args=[self.config.capacity_groups, data, header.start_version],
                    client=pipe,
                )
            ids = await pipe.execute()
        except RedisError as e:
            raise self._explain(e) from None
        stored = 0
        for entry in ids:
            if entry is None:
                break
            stored += 1
        return stored

    async def _take(
        self, batch_id: str, k: int, floor: int, wait_s: float, domain: str = ""
    ) -> tuple[list[bytes], int]:
        stream = self.streams[domain]
        try:
            await self._ensure_group()
            idle_ms = int(self.config.visibility_timeout_s * 1000)
            _, claimed, _ = await self.redis.xautoclaim(stream, GROUP, batch_id, idle_ms, "0-0", count=k)
            entries = list(claimed)
            if claimed:
                await self.redis.hincrby(self.stats_key, "redelivered", len(claimed))
            if len(entries) < k:
                # Block for new entries, but not so long that a batch passing its visibility
                # timeout meanwhile waits long for the next XAUTOCLAIM.
                poll_s = min(wait_s, max(0.05, self.config.visibility_timeout_s / 4), 1.0)
                # At least 1 ms: BLOCK 0 is "forever" (under 1 ms left, the read hung until the socket timeout).
                block = max(1, int(poll_s * 1000)) if not entries and poll_s > 0 else None
                res = await self.redis.xreadgroup(GROUP, batch_id, {stream: ">"}, count=k - len(entries), block=block)
                for _, rows in res or []:
                    entries += rows
            return await self._sort_out(stream, entries, floor)
        except RedisError as e:
            raise self._explain(e) from None

    async def _sort_out(self, stream: str, entries: list, floor: int) -> tuple[list[bytes], int]:
        """Keep fresh, readable groups; ack, delete and count the rest."""
        keep, stale, corrupt = [], [], []
        for entry_id, fields in entries:
            data, version = fields.get(b"d"), fields.get(b"v")
            try:
                if data is None or version is None:
                    raise CodecError("stream entry lacks its 'd' or 'v' field")
                read_header(data)
            except CodecError as e:
                log.error("dropping corrupt group %s: %s", entry_id, e)
                corrupt.append(entry_id)
                continue
            (stale if int(version) < floor else keep).append((entry_id, data))
        await self._drop(stream, [i for i, _ in stale], "dropped_stale")
        await self._drop(stream, corrupt, "dropped_corrupt")
        return [d for _, d in keep], len(stale)

    async def _drop(self, stream: str, ids: list[bytes], reason: str) -> None:
        if ids:
            pipe = self.redis.pipeline(transaction=True)
            pipe.xack(stream, GROUP, *ids).xdel(stream, *ids).hincrby(self.stats_key, reason, len(ids))
            await pipe.execute()

    async def _ack(self, batch_id: str) -> int:
        try:
            await self._ensure_group()
            args = [GROUP, batch_id, self.config.capacity_groups]
            acked = 0
            for stream in self.streams.values():  # a batch by domain holds entries of several streams
                acked += int(await self._ack_script(keys=[stream, self.stats_key], args=args))
            return acked
        except RedisError as e:
            raise self._explain(e) from None

    async def _handed_out(self, batch_id: str) -> None:
        """Reset the idle time of the batch's entries (XCLAIM to itself, JUSTID: nothing delivered again)."""
        try:
            for stream in self.streams.values():
                pending = await self.redis.xpending_range(
                    stream, GROUP, min="-", max="+", count=self.config.capacity_groups, consumername=batch_id
                )
                if pending:
                    ids = [p["message_id"] for p in pending]
                    await self.redis.xclaim(stream, GROUP, batch_id, 0, ids, justid=True)
        except RedisError as e:
            raise self._explain(e) from None

    async def _requeue(self) -> int:
        """Every pending entry gets the idle time of a batch past its visibility timeout (XCLAIM IDLE,
        a minute beyond it: Redis times idleness by its wall clock): the next XAUTOCLAIM hands it out
        again and counts it ``redelivered``. Entries a requeue already took back are not counted again."""
        idle_ms, back = int(self.config.visibility_timeout_s * 1000) + 60_000, 0
        try:
            await self._ensure_group()
            for stream in self.streams.values():
                pending = await self.redis.xpending_range(
                    stream, GROUP, min="-", max="+", count=self.config.capacity_groups
                )
                ids = [p["message_id"] for p in pending if p["consumer"] != REQUEUED]
                if ids:
                    back += len(await self.redis.xclaim(stream, GROUP, REQUEUED, 0, ids, idle=idle_ms, justid=True))
            return back
        except RedisError as e:
            raise self._explain(e) from None

    async def _forget(self, batch_id: str) -> None:
        try:
            for stream in self.streams.values():
                await self.redis.xgroup_delconsumer(stream, GROUP, batch_id)
        except RedisError as e:
            raise self._explain(e) from None

    async def _count(self, name: str, n: int = 1) -> None:
        try:
            await self.redis.hincrby(self.stats_key, name, n)
        except RedisError as e:
            raise self._explain(e) from None

    async def _stats(self) -> dict:
        try:
            await self._ensure_group()
            pipe = self.redis.pipeline(transaction=False)
            for stream in self.streams.values():
                pipe.xlen(stream).xpending(stream, GROUP)
            *sizes, counters = await pipe.hgetall(self.stats_key).execute()
        except RedisError as e:
            raise self._explain(e) from None
        depths = {d: n - int(p["pending"]) for d, n, p in zip(self.streams, sizes[::2], sizes[1::2], strict=True)}
        in_flight = sum(int(p["pending"]) for p in sizes[1::2])
        counters = {k.decode(): int(v) for k, v in counters.items()}
        return (
            {"depth": sum(depths.values()), "in_flight": in_flight}
            | {c: counters.get(c, 0) for c in COUNTERS}
            | {"by_domain": by_domain(counters, depths) if self.domains else {}}
        )
