"""Environments with typed actions (issue 63, part 2), against an OpenEnv server written with
openenv-core alone whose action is an integer and whose observation has no text: an answer it does
not validate ends the episode as the policy's mistake (scored ``env.invalid_action_reward``, its
tokens kept, counted), never as the provider's fault; ``env.action_format`` makes the action."""

from __future__ import annotations

import asyncio

import pytest

from rollout.envs.remote import RemoteEnv, RemoteEnvConfig
from services.auth import AuthConfig
from services.env_provider.clients import build_pool
from services.processes import stop_process
from tests.services.test_env_provider import _uvicorn_factory

FORMAT = "tests.services.provider_envs:grid_text"
ACTION = "tests.services.provider_envs:first_integer"


@pytest.fixture(scope="module")
def grid():
    proc, url = _uvicorn_factory("tests.services.provider_envs:openenv_grid_app")
    yield url
    stop_process(proc)


def _pool(protocol: str, url: str, **cfg):
    config = RemoteEnvConfig(protocol=protocol, addresses=[url], observation_format=FORMAT, token_env=None, **cfg)
    return build_pool(config, AuthConfig())


@pytest.mark.parametrize("protocol", ["http", "openenv"])
def test_an_answer_the_environment_does_not_validate_ends_the_episode_as_the_policys(grid, protocol):
    async def main():
        pool = _pool(protocol, grid, action_key="move", invalid_action_reward=-0.5)
        try:
            results = []
            for i, answer in enumerate(["0", "go up", "7", "0"]):  # "0" is a valid move; the rest are not
                env = RemoteEnv(pool, f"grid-{protocol}-{i}")
                first = await env.reset(i)
                results.append((first, await env.step(answer)))
                await env.close()
            return results, pool.counters, [m.up for m in pool.members]
        finally:
            await pool.aclose()

    results, counters, up = asyncio.run(main())
    first, won = results[0]
    assert first == "You are at [0, 0]; moves [0, 1, 2, 3] (0 up, 1 down, 2 left, 3 right)."
    assert (won.reward, won.done) == (1.0, True)
    for _, refused in results[1:3]:  # "go up" is no integer, 7 is out of range: the policy's mistakes
        assert (refused.observation, refused.reward, refused.done) == (None, -0.5, True)
        assert "move" in refused.info["invalid_action"]
    assert results[3][1].reward == 1.0  # the provider served on
    assert counters.get("invalid_action") == 2 and up == [True]
    assert not any(k.startswith("failed_") for k in counters), counters


@pytest.mark.parametrize("protocol", ["http", "openenv"])
def test_action_format_turns_the_models_text_into_the_typed_action(grid, protocol):
    async def main():
        pool = _pool(protocol, grid, action_format=ACTION)
        try:
            out = []
            for i, answer in enumerate(["I go up: 0", "no number here", "  3 then 1"]):
                env = RemoteEnv(pool, f"fmt-{protocol}-{i}")
                await env.reset(i)
                out.append(await env.step(answer))
                await env.close()
            return out, pool.counters
        finally:
            await pool.aclose()

    (up, none, right), counters = asyncio.run(main())
    assert (up.reward, up.done) == (1.0, True)
    assert (none.reward, none.done) == (0.0, True) and "no integer" in none.info["invalid_action"]
    assert right.reward == 0.0 and (right.done or right.observation.startswith("You are at [1, 0]"))
    assert counters.get("invalid_action") == 1


def test_action_format_is_checked_when_the_config_loads():
    with pytest.raises(ValueError, match=r"action_format: cannot import 'tests.services.provider_envs:nope'"):
        RemoteEnvConfig(protocol="openenv", addresses=["http://x"], action_format="tests.services.provider_envs:nope")
    with pytest.raises(ValueError, match="is not 'module:function'"):
        RemoteEnvConfig(protocol="http", addresses=["http://x"], action_format="rollout.envs.remote:PROTOCOLS")
    with pytest.raises(ValueError, match="action_format: a gRPC provider takes the model's text"):
        RemoteEnvConfig(protocol="grpc", addresses=["x:1"], action_format=ACTION)


def test_a_formatter_that_breaks_is_the_episodes_error_not_an_invalid_action(grid):
    from rollout.envs.remote import ProviderError

    async def main():
        pool = _pool("openenv", grid, action_format="builtins:divmod")  # a TypeError for one argument
        try:
            env = RemoteEnv(pool, "broken")
            await env.reset(0)
            with pytest.raises(ProviderError) as e:
                await env.step("0")
            await env.close()
            return e.value, pool.counters
        finally:
            await pool.aclose()

    error, counters = asyncio.run(main())
    assert error.kind == "action" and "TypeError" in str(error) and "invalid_action" not in counters


def test_the_rollout_loop_keeps_invalid_answers_for_training(grid):
    """Through the loop: members answering "go up" end as normal episodes (reward 0, tokens kept,
    loss mask on the answer), the groups are put; the EnvManager's metrics count them."""
    from sample_buffer.trajectory import FinishReason
    from tests.services.test_env_provider import loop_on_providers

    env = {"type": "remote", "protocol": "openenv", "addresses": [grid], "observation_format": FORMAT}
    env |= {"action_key": "move", "token_env": None}
    loop, _, pool, groups = loop_on_providers(env, lambda rid: {"0": "0", "1": "go up"}[rid[-1]], group_size=2)
    assert len(groups) == 2 and loop.counters["members_dropped_env_error"] == 0
    for g in groups:
        by_member = {t.trajectory_id.rsplit("/", 1)[1]: t for t in g.trajectories}
        assert by_member["0"].reward == 1.0 and by_member["1"].reward == 0.0
        refused = by_member["1"]
        assert refused.finish_reason == FinishReason.STOP and sum(refused.loss_mask) == len("go up")
    assert pool.counters["invalid_action"] >= 2
    from prometheus_client import generate_latest

    from services.env_manager.metrics import EnvMetrics

    metrics = EnvMetrics("remote", stats=lambda: {"running_episodes": 0, "workers": 2}, pools=(pool,))
    text = generate_latest(metrics.registry).decode()
    assert f"rollmesh_env_invalid_actions_total {float(pool.counters['invalid_action'])}" in text, text[-800:]
