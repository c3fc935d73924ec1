"""Environments: ``reset(seed) -> observation`` and ``step(action) -> observation, reward, done, info``.

``step`` may be a coroutine function (an environment that waits on I/O, like the simulated one).
"""

from __future__ import annotations

from rollout.envs.base import Env, StepResult
from rollout.envs.sim import SimEnv
from rollout.envs.single_turn import SingleTurnEnv, load_jsonl
from rollout.registry import resolve

ENVS = {"single_turn": SingleTurnEnv, "sim": SimEnv}


def make_env(name: str, rows: list[dict], reward_fn, args: dict | None = None) -> Env:
    """An environment by registry name or ``module:Class``, built as ``cls(rows, reward_fn, **args)``."""
    cls = resolve("env", name, ENVS, attr_kind="Class")
    return cls(rows, reward_fn, **(args or {}))


__all__ = ["ENVS", "Env", "SimEnv", "SingleTurnEnv", "StepResult", "load_jsonl", "make_env"]
