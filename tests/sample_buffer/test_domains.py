"""Batches by domain: weighted turns, and the buffer (both backends) assembling each batch by weight."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from sample_buffer.codec import CodecError, encode_group, read_header
from sample_buffer.domains import WeightedTurns
from sample_buffer.trajectory import TrajectoryError
from tests.sample_buffer.helpers import make_group, run

WEIGHTS = {"math": 0.5, "code": 0.3, "chat": 0.2}


def test_weighted_turns_follow_the_weights_at_every_prefix_and_in_every_window():
    rng = random.Random(0)
    for _ in range(200):
        weights = {f"d{i}": rng.random() + (1e-3 if i == 0 else 0) for i in range(rng.randint(2, 6))}
        share = {d: w / sum(weights.values()) for d, w in weights.items()}
        turns = WeightedTurns(weights)
        draws = [turns.draw() for _ in range(300)]
        counts = Counter()
        for n, d in enumerate(draws, 1):
            counts[d] += 1
            assert all(abs(counts[e] - share[e] * n) < 1 for e in weights), (weights, n)
        for start in range(0, 290):  # any batch of 10 consecutive draws
            window = Counter(draws[start : start + 10])
            assert all(abs(window[e] - share[e] * 10) < 2 for e in weights)


def test_weighted_turns_undo_owes_the_draw_and_a_refund_owes_at_most_one():
    turns = WeightedTurns({"a": 0.5, "b": 0.5})
    first = turns.draw()
    turns.undo(first)
    assert turns.draw() == first  # taken back: drawn again next
    turns = WeightedTurns({"a": 0.5, "b": 0.5})
    for _ in range(50):  # b's slot filled by a, 50 times: b is owed one draw, not 50
        assert turns.draw() in "ab"
        turns.refund("b")
    nxt = [turns.draw() for _ in range(10)]
    assert 5 <= nxt.count("b") <= 7
    with pytest.raises(ValueError, match="weights"):
        WeightedTurns({"a": 0.0})


def test_a_groups_domain_travels_in_its_header_and_a_bad_name_is_refused():
    data = encode_group(make_group("g", domain="math"))
    assert read_header(data).domain == "math"
    assert read_header(encode_group(make_group("h"))).domain == ""
    with pytest.raises(TrajectoryError, match="domain"):
        make_group("g", domain="no/slashes")
    bad = data.replace(b"math", b"ma:h")
    with pytest.raises(CodecError, match="domain"):
        read_header(bad)


def _put_all(buf, counts: dict[str, int], version: int = 0):
    async def go():
        for d, n in counts.items():
            for i in range(n):
                assert (await buf.put(make_group(f"{d}{i}", version=version, domain=d))).accepted

    return go()


def test_each_batch_holds_each_domains_share_whatever_order_the_groups_arrived_in(buffer_factory):
    """The fast domain's groups all arrive first; every batch of 10 still holds 5/3/2."""

    async def go():
        buf = buffer_factory(domain_weights=WEIGHTS)
        await _put_all(buf, {"math": 30, "code": 18, "chat": 12})
        batches = []
        for _ in range(6):
            batch = await buf.get(10, version=0, max_staleness=0, timeout_s=5)
            batches.append(Counter(g.domain for g in batch.decode()))
            await buf.ack(batch.batch_id)
        return batches, await buf.stats()

    batches, stats = run(go())
    for counts in batches:
        assert sum(counts.values()) == 10
        assert all(abs(counts[d] - w * 10) < 2 for d, w in WEIGHTS.items()), counts
    total = sum(batches, Counter())
    assert total == Counter({"math": 30, "code": 18, "chat": 12})
    assert stats["consumed"] == 60 and stats["in_flight"] == 0
    assert {d: row["handed_out"] for d, row in stats["by_domain"].items()} == {"math": 30, "code": 18, "chat": 12}


def test_a_domain_with_nothing_to_give_hands_its_slots_to_the_others_after_its_wait(buffer_factory):
    async def go():
        buf = buffer_factory(domain_weights={"math": 0.5, "code": 0.5}, domain_wait_s=0.3)
        await _put_all(buf, {"math": 8})
        batch = await buf.get(4, version=0, max_staleness=0, timeout_s=10)
        return batch.decode(), await buf.stats()

    groups, stats = run(go())
    assert [g.domain for g in groups] == ["math"] * 4  # a full batch, not a timeout
    assert stats["by_domain"]["code"]["substituted"] == 2 and stats["by_domain"]["math"]["depth"] == 4


def test_a_batch_cut_by_its_timeout_leaves_the_missing_domains_slots_owed_to_the_next(buffer_factory):
    async def go():
        buf = buffer_factory(domain_weights={"math": 0.5, "code": 0.5}, domain_wait_s=60)
        await _put_all(buf, {"math": 4})
        first = await buf.get(4, version=0, max_staleness=0, timeout_s=0.3)  # code has none: 2 of 4
        await _put_all(buf, {"code": 4})
        second = await buf.get(4, version=0, max_staleness=0, timeout_s=5)
        return first.decode(), second.decode()

    first, second = run(go())
    assert [g.domain for g in first] == ["math", "math"]
    assert Counter(g.domain for g in second) == {"code": 3, "math": 1}  # code's 2 owed slots, then 1 and 1


def test_a_group_of_a_domain_the_buffer_does_not_take_is_refused_and_nothing_of_its_call_stored(buffer_factory):
    async def go():
        buf = buffer_factory(domain_weights=WEIGHTS)
        with pytest.raises(CodecError, match="domain: 'poetry'"):
            await buf.put_many([make_group("ok", domain="math"), make_group("bad", domain="poetry")])
        with pytest.raises(CodecError, match="domain: ''"):
            await buf.put(make_group("none"))
        return await buf.stats()

    assert run(go())["put"] == 0


def test_capacity_counts_every_domains_groups(buffer_factory):
    async def go():
        buf = buffer_factory(domain_weights=WEIGHTS, capacity_groups=3, put_timeout_s=0.2)
        await _put_all(buf, {"math": 2, "code": 1})
        [result] = await buf.put_many([make_group("late", domain="chat")])
        return result

    assert run(go()).reason == "full"


def test_filtered_groups_are_counted_by_domain(buffer_factory):
    async def go():
        buf = buffer_factory(domain_weights=WEIGHTS)
        await buf.put(make_group("same", rewards=(1.0, 1.0), domain="code"))
        return await buf.stats()

    stats = run(go())
    assert stats["dropped_filtered"] == 1 and stats["by_domain"]["code"]["dropped_filtered"] == 1


def test_a_dead_domains_slots_go_to_the_others_by_their_weights_and_it_is_owed_one_at_most(buffer_factory):
    """'chat' (0.2) has nothing for 10 batches: its slots go to math and code as 0.5 : 0.3 (not all to
    the heaviest), nobody is charged for them; when chat comes back it gets its share, not a burst."""

    async def go():
        buf = buffer_factory(domain_weights=WEIGHTS, domain_wait_s=0.05)
        await _put_all(buf, {"math": 80, "code": 80})
        dead = Counter()
        for _ in range(10):
            batch = await buf.get(10, version=0, max_staleness=0, timeout_s=10)
            dead += Counter(g.domain for g in batch.decode())
            await buf.ack(batch.batch_id)
        await _put_all(buf, {"chat": 20})
        back = await buf.get(10, version=0, max_staleness=0, timeout_s=10)
        return dead, Counter(g.domain for g in back.decode()), await buf.stats()

    dead, back, stats = run(go())
    assert sum(dead.values()) == 100 and abs(dead["math"] - 62.5) <= 2 and abs(dead["code"] - 37.5) <= 2
    # its 2 slots a batch, counted once, and the one draw it is owed after a refund
    assert stats["by_domain"]["chat"]["substituted"] == 21
    assert 2 <= back["chat"] <= 3


def test_a_batch_hands_its_groups_out_before_their_visibility_timeout_can_expire(buffer_factory):
    """A batch waiting for a domain that has nothing returns what it holds at half the visibility
    timeout, and its clock starts then: nothing is handed out twice."""

    async def go():
        buf = buffer_factory(domain_weights={"math": 0.5, "code": 0.5}, domain_wait_s=60, visibility_timeout_s=1.0)
        await _put_all(buf, {"math": 1})
        held = await buf.get(2, version=0, max_staleness=0, timeout_s=30)  # code never comes
        await asyncio.sleep(0.7)  # past the visibility timeout counted from the first take, not from the return
        other = await buf.get(2, version=0, max_staleness=0, timeout_s=0.05)
        acked = await buf.ack(held.batch_id)
        return held.decode(), other.decode(), acked, await buf.stats()

    held, other, acked, stats = run(go())
    assert [g.domain for g in held] == ["math"] and other == [] and acked == 1
    assert stats["redelivered"] == 0 and stats["consumed"] == 1


def test_a_dead_domain_is_waited_for_once_not_in_every_batch(buffer_factory):
    """The first batch waits domain_wait_s for 'code', then fills from 'math'; the next batch, asked
    with less time than that wait, is full at once: code has given nothing since."""

    async def go():
        buf = buffer_factory(domain_weights={"math": 0.5, "code": 0.5}, domain_wait_s=0.3)
        await _put_all(buf, {"math": 8})
        first = await buf.get(4, version=0, max_staleness=0, timeout_s=10)
        second = await buf.get(4, version=0, max_staleness=0, timeout_s=0.1)
        await _put_all(buf, {"code": 2})
        third = await buf.get(2, version=0, max_staleness=0, timeout_s=10)  # code is back: its share again
        return first.decode(), second.decode(), third.decode()

    first, second, third = run(go())
    assert len(first) == 4 and len(second) == 4 and {g.domain for g in first + second} == {"math"}
    assert [g.domain for g in third].count("code") >= 1
