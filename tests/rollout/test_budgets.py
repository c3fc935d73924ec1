"""Latency budgets in one episode, in-process: the environment declares them, the episode keeps
them, and a missed one ends the trajectory as ``timeout`` naming the budget."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollout.budgets import Budgets, EpisodeClock
from rollout.envs.base import StepResult
from rollout.episode import EpisodeConfig, LatencyPenalty, run_episode
from rollout.ports import Generation
from rollout.sampling import SamplingParams
from sample_buffer.trajectory import FinishReason
from tests.rollout.test_loop import CharTokenizer


class SlowEnv:
    """``turns`` steps of ``step_s`` seconds each; reward 1 at the end."""

    name = "slow"

    def __init__(self, budgets: Budgets | None, step_s: float = 0.0, turns: int = 3) -> None:
        self.budgets, self.step_s, self.turns, self.steps = budgets, step_s, turns, 0

    def reset(self, seed: int) -> str:
        return "go"

    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(self.step_s)
        self.steps += 1
        return StepResult(None, 1.0, True) if self.steps >= self.turns else StepResult("more", 0.0, False)


def scripted(calls: list, delay_s: float = 0.0):
    async def generate(ids, sampling, tid, timeout_s) -> Generation:
        calls.append((sampling.max_new_tokens, timeout_s))
        if delay_s > timeout_s:  # what the LLMProxy answers at a generation's deadline
            await asyncio.sleep(timeout_s)
            return Generation([], [], [], FinishReason.TIMEOUT)
        await asyncio.sleep(delay_s)
        return Generation([ord("a")], [-0.1], [0], FinishReason.STOP)

    return generate


def episode(env, generate, **cfg):
    config = EpisodeConfig(max_turns=5, sampling=SamplingParams(max_new_tokens=32), **cfg)
    t0 = time.monotonic()
    traj = asyncio.run(
        run_episode(env, 0, generate, CharTokenizer(), config, trajectory_id="t/0", group_id="t", prompt_id="p0")
    )
    return traj, time.monotonic() - t0


def test_the_clock_takes_the_tighter_limit_and_what_is_left_of_the_episode():
    clock = EpisodeClock(30.0, 60.0, Budgets(step_s=2.0, generation_tokens=8, episode_s=5.0), started=time.monotonic())
    assert clock.step() == (2.0, "step") and clock.generation() == (pytest.approx(5.0, abs=0.01), "episode")
    assert clock.sampling(SamplingParams(max_new_tokens=32)).max_new_tokens == 8
    assert clock.sampling(SamplingParams(max_new_tokens=4)).max_new_tokens == 4  # the config's is tighter
    late = EpisodeClock(30.0, 60.0, Budgets(episode_s=5.0), started=time.monotonic() - 6)
    assert late.step() == (0.0, "episode")
    assert EpisodeClock(30.0, 60.0, None).step() == (30.0, "step")


def test_a_missed_step_budget_ends_the_episode_at_the_budget():
    traj, took = episode(SlowEnv(Budgets(step_s=0.1), step_s=5.0), scripted([]))
    assert traj.finish_reason == FinishReason.TIMEOUT and traj.metadata["timeout"] == "step"
    assert took < 1.0  # the step's budget, not the config's 30 s


def test_a_generation_gets_the_budgets_deadline_and_tokens():
    calls = []
    traj, took = episode(SlowEnv(Budgets(generation_s=0.1, generation_tokens=4)), scripted(calls, delay_s=5.0))
    assert calls == [(4, pytest.approx(0.1))]
    assert traj.finish_reason == FinishReason.TIMEOUT and traj.metadata["timeout"] == "generation" and took < 1.0


def test_the_episode_budget_bounds_the_whole_episode():
    traj, took = episode(SlowEnv(Budgets(episode_s=0.25), step_s=0.1, turns=5), scripted([]))
    assert traj.finish_reason == FinishReason.TIMEOUT and traj.metadata["timeout"] == "episode"
    assert 0.2 < took < 0.6 and len(traj.metadata["turn_starts"]) in (2, 3)


def test_without_budgets_the_config_limits_apply():
    calls = []
    traj, _ = episode(SlowEnv(None), scripted(calls))
    assert traj.finish_reason == FinishReason.STOP and traj.reward == 1.0
    assert calls == [(32, 60.0)] * 3


def test_the_latency_penalty_charges_each_turn_over_its_target():
    penalty = LatencyPenalty(target_s=0.05, penalty=0.1)
    fast, _ = episode(SlowEnv(None, step_s=0.0), scripted([]), latency_penalty=penalty)
    slow, _ = episode(SlowEnv(None, step_s=0.08), scripted([]), latency_penalty=penalty)
    assert fast.reward == pytest.approx(1.0) and fast.metadata["turns_over_target"] == 0
    assert slow.reward == pytest.approx(1.0 - 3 * 0.1) and slow.metadata["turns_over_target"] == 3
