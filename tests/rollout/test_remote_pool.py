"""The provider pool's decisions without a socket: scripted clients answer busy or not at all."""

from __future__ import annotations

import asyncio

import pytest

from rollout.envs.remote import Observation, ProviderError, ProviderInfo, ProviderPool, RemoteEnv, RemoteEnvConfig


class Scripted:
    """A provider whose reset answers ``reset_error`` (raised) or a first observation."""

    def __init__(self, address: str, reset_error: Exception | None = None) -> None:
        self.address, self.reset_error, self.resets = address, reset_error, 0

    async def describe(self, timeout_s):
        return ProviderInfo(name="scripted")

    async def reset(self, episode_id, seed, timeout_s):
        self.resets += 1
        if self.reset_error is not None:
            raise self.reset_error
        return Observation(f"start {seed}")

    async def healthy(self, timeout_s):
        return True

    async def close_episode(self, episode_id, timeout_s):
        pass

    async def aclose(self):
        pass


def pool_of(*clients) -> ProviderPool:
    return ProviderPool(list(clients), RemoteEnvConfig(addresses=[c.address for c in clients], health_interval_s=60))


def test_a_busy_provider_stays_in_rotation_and_the_reset_goes_elsewhere():
    busy = Scripted("busy:1", ProviderError("busy", "at max_sessions", retryable=True))
    free = Scripted("free:1")
    pool = pool_of(busy, free)
    firsts = [asyncio.run(RemoteEnv(pool, f"e{i}").reset(i, timeout_s=5)) for i in range(3)]
    assert firsts == ["start 0", "start 1", "start 2"]
    assert all(m.up for m in pool.members) and "marked_down" not in pool.counters  # it answered: not at fault
    assert pool.counters["failed_busy"] == busy.resets >= 1


def test_a_provider_that_does_not_answer_leaves_the_rotation():
    silent = Scripted("silent:1", TimeoutError("no answer"))
    pool = pool_of(silent, Scripted("free:1"))
    assert asyncio.run(RemoteEnv(pool, "e").reset(0, timeout_s=5)) == "start 0"
    assert not pool.members[0].up and pool.counters["marked_down"] == 1
    with pytest.raises(ProviderError) as e:  # refused: not the provider's fault, and not retried
        asyncio.run(RemoteEnv(pool_of(Scripted("no:1", ProviderError("refused", "bad seed"))), "e").reset(0, 5))
    assert e.value.kind == "refused"
