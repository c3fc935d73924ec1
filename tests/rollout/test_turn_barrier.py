import asyncio

import pytest
from pydantic import TypeAdapter, ValidationError

from rollout.envs import EnvConfig, SimEnv
from rollout.turn_barrier import TurnBarrier
from sample_buffer.deadlines import wait_for


def test_nobody_passes_until_every_live_party_arrives():
    async def main():
        barrier, order = TurnBarrier(3), []

        async def party(name: str, delay: float, rounds: int):
            for r in range(rounds):
                await asyncio.sleep(delay)
                order.append(f"{name}{r}-arrive")
                await barrier.wait()
                order.append(f"{name}{r}-pass")
            barrier.leave()

        await wait_for(asyncio.gather(party("a", 0.0, 2), party("b", 0.01, 1), party("c", 0.03, 2)), 5)
        return order

    order = asyncio.run(main())
    first_pass = min(i for i, e in enumerate(order) if e.endswith("-pass"))
    assert {"a0-arrive", "b0-arrive", "c0-arrive"} <= set(order[:first_pass])  # round 0 waited for all three
    # b left after one round, so round 1 needed only a and c (no deadlock).
    assert order.count("a1-pass") == 1 and order.count("c1-pass") == 1
    with pytest.raises(ValueError, match="parties"):
        TurnBarrier(0)


def test_sim_env_latency_turns_and_registry():
    load = TypeAdapter(EnvConfig).validate_python
    args = {"type": "sim", "turns": 2, "latency_median_s": 1.0, "latency_sigma": 0.0, "time_scale": 50}
    env = load(args).build([{"prompt": "p0"}, {"prompt": "p1"}], None)
    assert isinstance(env, SimEnv) and env.reset(1) == "p1"

    async def episode():
        t0 = asyncio.get_running_loop().time()
        first = await env.step("x")
        second = await env.step("y")
        return first, second, asyncio.get_running_loop().time() - t0

    first, second, wall = asyncio.run(episode())
    assert not first.done and first.observation and second.done and second.reward in (0.0, 1.0)
    assert 0.035 < wall < 0.2  # 2 steps x 1 simulated second / 50
    with pytest.raises(ValidationError, match="nope"):  # an unknown environment
        load({"type": "nope"})
    with pytest.raises(ValidationError, match="turns"):  # its own arguments are checked at load
        load({"type": "sim", "turns": 0})
    with pytest.raises(ValidationError, match="turn_count"):  # and a misspelled one is named
        load({"type": "sim", "turn_count": 2})
    with pytest.raises(ValidationError, match="cls"):  # a custom class that cannot be imported
        load({"type": "custom", "cls": "no_such_module:Env"})
