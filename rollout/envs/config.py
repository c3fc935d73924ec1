"""Environments as typed variants: ``env: {type: sim, turns: 4}`` names the environment and
carries its own arguments, checked when the config is loaded (a wrong argument names its key)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout.envs.base import Env
from rollout.envs.calculator import CalculatorEnvConfig
from rollout.envs.gem_game import GemEnvConfig
from rollout.envs.remote import RemoteEnvConfig
from rollout.envs.sim import SimEnvConfig
from rollout.envs.single_turn import SingleTurnEnv
from sample_buffer.registry import resolve, tagged_union


class SingleTurnEnvConfig(BaseModel):
    """One prompt, one response, scored by the reward function (``rollout/envs/single_turn.py``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["single_turn"] = Field("single_turn", description="Selects this environment.")

    def build(self, rows: list[dict], reward_fn: Callable) -> Env:
        return SingleTurnEnv(rows, reward_fn)


class CustomEnvConfig(BaseModel):
    """A user's own environment class, built as ``cls(rows, reward_fn, **args)``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["custom"] = Field("custom", description="Selects a user's own environment class.")
    cls: str = Field(..., description="'module:Class' of the environment (reset(seed) / step(action)).")
    args: dict = Field(default_factory=dict, description="Keyword arguments of the class's constructor.")

    @field_validator("cls")
    @classmethod
    def _importable(cls, name: str) -> str:
        if ":" not in name:
            raise ValueError(f"expected 'module:Class', got {name!r}")
        resolve("cls", name, {}, attr_kind="Class")
        return name

    def build(self, rows: list[dict], reward_fn: Callable) -> Env:
        return resolve("cls", self.cls, {}, attr_kind="Class")(rows, reward_fn, **self.args)


EnvConfig = tagged_union(
    SingleTurnEnvConfig,
    SimEnvConfig,
    CalculatorEnvConfig,
    GemEnvConfig,
    CustomEnvConfig,
    RemoteEnvConfig,
    default="single_turn",
)
