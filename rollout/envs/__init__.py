"""Environments: ``reset(seed) -> observation`` and ``step(action) -> observation, reward, done, info``.

``step`` may be a coroutine function (an environment that waits on I/O, like the simulated one).
Which environment a pool runs is a typed variant of its config (``rollout/envs/config.py``).
"""

from __future__ import annotations

from rollout.envs.base import Env, StepResult
from rollout.envs.config import CustomEnvConfig, EnvConfig, SingleTurnEnvConfig
from rollout.envs.sim import SimEnv, SimEnvConfig
from rollout.envs.single_turn import SingleTurnEnv, load_jsonl

__all__ = [
    "CustomEnvConfig",
    "Env",
    "EnvConfig",
    "SimEnv",
    "SimEnvConfig",
    "SingleTurnEnv",
    "SingleTurnEnvConfig",
    "StepResult",
    "load_jsonl",
]
