"""Environments: ``reset(seed) -> observation`` and ``step(action) -> observation, reward, done, info``."""

from rollout.envs.base import Env, StepResult
from rollout.envs.single_turn import SingleTurnEnv, load_jsonl

__all__ = ["Env", "SingleTurnEnv", "StepResult", "load_jsonl"]
