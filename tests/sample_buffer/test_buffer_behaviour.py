"""One behavioural suite for both backends: the Redis one runs against a real redis-server."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sample_buffer.buffer import BufferFull
from sample_buffer.codec import CodecError
from sample_buffer.deadlines import wait_for
from tests.sample_buffer.helpers import make_group, run


def ids(batch):
    return [g.group_id for g in batch.decode()]


def test_put_get_ack_round_trip_oldest_first(buffer_factory):
    async def go():
        buf = buffer_factory()
        for i in range(5):
            assert (await buf.put(make_group(f"g{i}", version=1))).accepted
        batch = await buf.get(3, version=1, max_staleness=0, timeout_s=2)
        mid = await buf.stats()
        assert await buf.ack(batch.batch_id) == 3
        rest = await buf.get(3, version=1, max_staleness=0, timeout_s=0.2)
        return batch, mid, rest, await buf.stats()

    batch, mid, rest, stats = run(go())
    assert ids(batch) == ["g0", "g1", "g2"] and batch.decode()[0].trajectories[0].trajectory_id == "g0/0"
    assert (mid["depth"], mid["in_flight"]) == (2, 3)
    assert ids(rest) == ["g3", "g4"]  # partial batch at the timeout
    assert stats["put"] == 5 and stats["consumed"] == 3 and stats["in_flight"] == 2


def test_freshness_at_the_boundary_versions(buffer_factory):
    async def go():
        buf = buffer_factory()
        for v in (1, 2, 3, 4, 5, 6):
            await buf.put(make_group(f"v{v}", version=v))
        fresh = await buf.get(10, version=5, max_staleness=2, timeout_s=0.2)
        on_policy_buf = buffer_factory()
        for v in (4, 5):
            await on_policy_buf.put(make_group(f"w{v}", version=v))
        on_policy = await on_policy_buf.get(10, version=5, max_staleness=0, timeout_s=0.2)
        return fresh, await buf.stats(), on_policy, await on_policy_buf.stats()

    fresh, stats, on_policy, stats0 = run(go())
    assert ids(fresh) == ["v3", "v4", "v5", "v6"]  # 5 - 2 = 3 is the oldest allowed
    assert stats["dropped_stale"] == 2 and stats["depth"] == 0
    assert fresh.dropped_stale == 2  # reported to the consumer, who returns their admission slots
    assert ids(on_policy) == ["w5"] and stats0["dropped_stale"] == 1 and on_policy.dropped_stale == 1


def test_zero_variance_groups_are_filtered_and_counted(buffer_factory):
    async def go():
        buf = buffer_factory()
        flat = await buf.put(make_group("flat", rewards=(1.0, 1.0, 1.0)))
        kept = await buf.put(make_group("mixed", rewards=(1.0, 0.0, 1.0)))
        unfiltered = buffer_factory(filter_zero_variance=False)
        also = await unfiltered.put(make_group("flat2", rewards=(0.0, 0.0)))
        # A teacher's per-token log-probs are a signal whatever the rewards (on-policy distillation).
        zero = make_group("taught", rewards=(0.0, 0.0))
        for t in zero.trajectories:
            t.teacher_logprobs = np.full(t.num_generated, -1.0, dtype=np.float32)
        taught = await buf.put(zero)
        return flat, kept, also, taught, await buf.stats()

    flat, kept, also, taught, stats = run(go())
    assert not flat.accepted and flat.reason == "filtered" and kept.accepted and also.accepted and taught.accepted
    assert stats["dropped_filtered"] == 1 and stats["put"] == 2


def test_unacked_batch_is_redelivered_after_the_visibility_timeout(buffer_factory):
    async def go():
        # 1 s of invisibility: long enough that a loaded machine cannot make the "still invisible"
        # check below race the redelivery (0.3 s did, once, in a full-suite run).
        buf = buffer_factory(visibility_timeout_s=1.0)
        for i in range(3):
            await buf.put(make_group(f"r{i}"))
        first = await buf.get(3, 0, 0, timeout_s=1)
        nothing = await buf.get(3, 0, 0, timeout_s=0.05)  # still invisible
        again = await buf.get(3, 0, 0, timeout_s=5)  # the first consumer "died"
        late_ack = await buf.ack(first.batch_id)
        ack = await buf.ack(again.batch_id)
        twice = await buf.ack(again.batch_id)
        after = await buf.get(3, 0, 0, timeout_s=0.1)
        return first, nothing, again, late_ack, ack, twice, after, await buf.stats()

    first, nothing, again, late_ack, ack, twice, after, stats = run(go())
    assert ids(first) == ids(again) == ["r0", "r1", "r2"] and nothing.groups == []
    assert first.batch_id != again.batch_id
    assert (late_ack, ack, twice) == (0, 3, 0)  # consumed exactly once
    assert after.batch_id == "" and after.groups == []  # acked: never handed out again
    assert stats["consumed"] == 3 and stats["redelivered"] == 3 and stats["in_flight"] == 0


def test_requeue_hands_a_dead_consumers_batches_out_again_at_once_in_their_order(buffer_factory):
    """A trainer that starts requeues what its dead predecessor held: handed out again now, not at the
    visibility timeout (an hour here), before newer groups; an ack of the dead one's batch consumes nothing."""

    async def go():
        buf = buffer_factory(visibility_timeout_s=3600)
        for i in range(3):
            await buf.put(make_group(f"q{i}"))
        held = await buf.get(2, 0, 0, timeout_s=1)  # the predecessor's, never acked
        back = await buf.requeue()
        again = await buf.get(3, 0, 0, timeout_s=1)
        late_ack, ack = await buf.ack(held.batch_id), await buf.ack(again.batch_id)
        return held, back, again, late_ack, ack, await buf.requeue(), await buf.stats()

    held, back, again, late_ack, ack, none_left, stats = run(go())
    assert ids(held) == ["q0", "q1"] and back == 2 and ids(again) == ["q0", "q1", "q2"]
    assert (late_ack, ack, none_left) == (0, 3, 0)
    assert stats["consumed"] == 3 and stats["redelivered"] == 2 and stats["in_flight"] == 0


def test_full_buffer_makes_put_wait_then_fail_clearly(buffer_factory):
    async def go():
        buf = buffer_factory(capacity_groups=2)
        await buf.put(make_group("a"))
        await buf.put(make_group("b"))
        with pytest.raises(BufferFull, match="full"):
            await buf.put(make_group("c"), timeout_s=0.2)
        waiting = asyncio.create_task(buf.put(make_group("d"), timeout_s=5))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        batch = await buf.get(1, 0, 0, timeout_s=1)
        await asyncio.sleep(0.1)
        assert not waiting.done()  # handed out but not acked still takes room
        await buf.ack(batch.batch_id)
        assert (await wait_for(waiting, 5)).accepted
        return await buf.stats()

    stats = run(go())
    assert stats["dropped_capacity"] == 1 and stats["put"] == 3 and stats["depth"] == 2


def test_two_concurrent_consumers_never_get_the_same_group(buffer_factory):
    async def go():
        buf = buffer_factory()
        n = 40
        for i in range(n):
            await buf.put(make_group(f"c{i}"))
        seen: dict[str, list[str]] = {"A": [], "B": []}

        async def consumer(name):
            while True:
                batch = await buf.get(3, 0, 0, timeout_s=0.3)
                if not batch.groups:
                    return
                seen[name] += ids(batch)
                await asyncio.sleep(0.001)
                await buf.ack(batch.batch_id)

        await asyncio.gather(consumer("A"), consumer("B"))
        return n, seen, await buf.stats()

    n, seen, stats = run(go())
    assert not set(seen["A"]) & set(seen["B"])
    assert sorted(seen["A"] + seen["B"]) == sorted(f"c{i}" for i in range(n))
    assert seen["A"] and seen["B"] and stats["consumed"] == n


def test_bad_payload_is_refused_and_nothing_is_lost(buffer_factory):
    async def go():
        buf = buffer_factory()
        await buf.put(make_group("ok"))
        with pytest.raises(CodecError):
            await buf.put(b"\x01\x00garbage")
        with pytest.raises(ValueError, match="max_staleness"):
            await buf.get(1, 0, -1, timeout_s=0)
        with pytest.raises(ValueError, match="num_groups"):
            await buf.get(0, 0, 0, timeout_s=0)
        return await buf.get(1, 0, 0, timeout_s=1), await buf.stats()

    batch, stats = run(go())
    assert ids(batch) == ["ok"] and stats["put"] == 1


def test_every_group_ends_in_exactly_one_state(buffer_factory):
    async def go():
        buf = buffer_factory(capacity_groups=6)
        attempts = 0
        for i in range(10):
            attempts += 1
            try:
                await buf.put(
                    make_group(f"s{i}", version=i % 4, rewards=(1.0, 1.0) if i % 5 == 0 else (0.0, 1.0)), timeout_s=0.01
                )
            except BufferFull:
                pass
        batch = await buf.get(2, version=3, max_staleness=1, timeout_s=0.5)
        await buf.ack(batch.batch_id)
        await buf.get(1, version=3, max_staleness=1, timeout_s=0.5)  # left in flight
        return attempts, await buf.stats()

    attempts, s = run(go())
    ended = s["consumed"] + s["dropped_stale"] + s["dropped_filtered"] + s["dropped_capacity"]
    assert attempts == ended + s["depth"] + s["in_flight"]
    assert s["dropped_filtered"] == 2 and s["dropped_capacity"] >= 1 and s["dropped_stale"] >= 1


def test_put_many_keeps_order_filters_and_stops_at_capacity(buffer_factory):
    async def go():
        buf = buffer_factory(capacity_groups=3)
        res = await buf.put_many(
            [make_group("m0"), make_group("flat", rewards=(2.0, 2.0)), make_group("m1"), make_group("m2")]
        )
        full = await buf.put_many([make_group("m3"), make_group("m4")], timeout_s=0.1)
        assert [(r.accepted, r.reason) for r in full] == [(False, "full"), (False, "full")]
        await buf.ack((await buf.get(1, 0, 0, timeout_s=0.2)).batch_id)  # room for one
        partial = await buf.put_many([make_group("m5"), make_group("m6")], timeout_s=0.1)
        assert [(r.accepted, r.reason) for r in partial] == [(True, ""), (False, "full")]  # each learns its own
        with pytest.raises(CodecError):
            await buf.put_many([make_group("m7"), b"junk"])  # checked before anything is stored
        batch = await buf.get(10, 0, 0, timeout_s=0.2)
        return res, batch, await buf.stats()

    res, batch, stats = run(go())
    assert [r.accepted for r in res] == [True, False, True, True] and res[1].reason == "filtered"
    assert ids(batch) == ["m1", "m2", "m5"]  # m0 was taken and acked to make room for m5
    assert stats["put"] == 4 and stats["dropped_capacity"] == 3 and stats["dropped_filtered"] == 1
