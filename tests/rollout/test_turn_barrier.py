import asyncio

import pytest

from rollout.envs import SimEnv, make_env
from rollout.turn_barrier import TurnBarrier


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

        await asyncio.wait_for(asyncio.gather(party("a", 0.0, 2), party("b", 0.01, 1), party("c", 0.03, 2)), 5)
        return order

    order = asyncio.run(main())
    first_pass = min(i for i, e in enumerate(order) if e.endswith("-pass"))
    assert {"a0-arrive", "b0-arrive", "c0-arrive"} <= set(order[:first_pass])  # round 0 waited for all three
    # b left after one round, so round 1 needed only a and c (no deadlock).
    assert order.count("a1-pass") == 1 and order.count("c1-pass") == 1
    with pytest.raises(ValueError, match="parties"):
        TurnBarrier(0)


def test_sim_env_latency_turns_and_registry():
    args = {"turns": 2, "latency_median_s": 1.0, "latency_sigma": 0.0, "time_scale": 50}
    env = make_env("sim", [{"prompt": "p0"}, {"prompt": "p1"}], None, args)
    assert isinstance(env, SimEnv) and env.reset(1) == "p1"

    async def episode():
        t0 = asyncio.get_running_loop().time()
        first = await env.step("x")
        second = await env.step("y")
        return first, second, asyncio.get_running_loop().time() - t0

    first, second, wall = asyncio.run(episode())
    assert not first.done and first.observation and second.done and second.reward in (0.0, 1.0)
    assert 0.035 < wall < 0.2  # 2 steps x 1 simulated second / 50
    with pytest.raises(ValueError, match="unknown"):
        make_env("nope", [], None)
    with pytest.raises(Exception, match="turns"):
        make_env("sim", [{"prompt": "p"}], None, {"turns": 0})
