"""Environments: ``reset(seed) -> observation`` and ``step(action) -> observation, reward, done, info``.

``step`` may be a coroutine function (an environment that waits on I/O, like the simulated one).
"""

from __future__ import annotations

import importlib

from rollout.envs.base import Env, StepResult
from rollout.envs.sim import SimEnv
from rollout.envs.single_turn import SingleTurnEnv, load_jsonl

ENVS = {"single_turn": SingleTurnEnv, "sim": SimEnv}


def make_env(name: str, rows: list[dict], reward_fn, args: dict | None = None) -> Env:
    """An environment by registry name or ``module:Class``, built as ``cls(rows, reward_fn, **args)``."""
    if name in ENVS:
        cls = ENVS[name]
    elif ":" in name:
        module, attr = name.split(":", 1)
        cls = getattr(importlib.import_module(module), attr)
    else:
        raise ValueError(f"env: unknown {name!r}; choose from {sorted(ENVS)} or 'module:Class'")
    return cls(rows, reward_fn, **(args or {}))


__all__ = ["ENVS", "Env", "SimEnv", "SingleTurnEnv", "StepResult", "load_jsonl", "make_env"]
