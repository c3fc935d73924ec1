"""A simulated environment for ``rollmesh bench async``: turns and step latency from a model.

Each step sleeps for a latency drawn from a lognormal (median, sigma) in simulated seconds,
compressed by ``time_scale`` like the simulated engines, and the episode lasts ``turns``
steps. The reward is a coin flip (seeded per episode), so GRPO groups carry signal. A high
``latency_sigma`` is the agentic case: a few slow tool calls or sandboxes hold whole batches
back in synchronous rollout.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout.budgets import Budgets
from rollout.envs.base import StepResult


class SimEnvConfig(BaseModel):
    """Simulated turns and step latency (``rollout/envs/sim.py``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["sim"] = Field("sim", description="Selects the simulated environment.")
    turns: int = Field(1, ge=1, description="Environment steps per episode.")
    latency_median_s: float = Field(0.5, ge=0, description="Median simulated seconds of one step (reward included).")
    latency_sigma: float = Field(0.5, ge=0, description="Lognormal sigma of the step latency (0 = constant).")
    latency_cap_s: float = Field(600.0, gt=0, description="Longest simulated step.")
    time_scale: float = Field(100.0, gt=0, description="Simulated seconds per wall second (match the engines').")
    budgets: Budgets | None = Field(None, description="The latency budgets it declares (wall seconds, tokens).")
    slow_step_share: float = Field(
        0.0, ge=0, le=1, description="Fail-slow: this share of steps takes slow_factor times its drawn latency."
    )
    slow_factor: float = Field(20.0, ge=1, description="How much slower a fail-slow step is.")
    stuck_episode_share: float = Field(
        0.0, ge=0, le=1, description="Fail-stop: this share of episodes never answers a step (until cancelled)."
    )

    def build(self, rows: list[dict], reward_fn=None) -> SimEnv:
        return SimEnv(rows, self)


class SimEnv:
    name = "sim"
    _instances = itertools.count()  # the n envs of a group share a seed; this tells them apart

    def __init__(self, rows: list[dict], config: SimEnvConfig | None = None) -> None:
        self.rows, self.config = rows, config or SimEnvConfig()
        self.budgets = self.config.budgets
        self._id = next(self._instances)
        self._rng = random.Random(self._id)
        self._turn = 0
        self._stuck = False

    def reset(self, seed: int) -> str:
        self._rng = random.Random(seed * 1_000_003 + self._id)
        self._turn = 0
        # Faults draw only where configured: without them, every episode's draws are as they were.
        self._stuck = self.config.stuck_episode_share > 0 and self._rng.random() < self.config.stuck_episode_share
        return self.rows[seed % len(self.rows)]["prompt"]

    def latency_s(self) -> float:
        c = self.config
        if c.latency_median_s == 0:
            return 0.0
        latency = self._rng.lognormvariate(math.log(c.latency_median_s), c.latency_sigma)
        if c.slow_step_share > 0 and self._rng.random() < c.slow_step_share:
            latency *= c.slow_factor
        return min(c.latency_cap_s, latency)

    async def step(self, action: str) -> StepResult:
        if self._stuck:  # a fail-stop environment: no answer, ever (the caller's deadline ends it)
            await asyncio.Event().wait()
        await asyncio.sleep(self.latency_s() / self.config.time_scale)
        self._turn += 1
        if self._turn < self.config.turns:
            return StepResult("continue", 0.0, False)
        return StepResult(None, float(self._rng.random() < 0.5), True)
