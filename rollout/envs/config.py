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
from rollout.envs.verifiers_env import VerifiersEnvConfig
from sample_buffer.registry import resolve, tagged_union


class SingleTurnEnvConfig(BaseModel):
    """One prompt, one response, scored by the reward function (``rollout/envs/single_turn.py``);
    with ``tries`` > 1 a wrong answer is told so and answered again (a multi-turn episode)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["single_turn"] = Field("single_turn", description="Selects this environment.")
    tries: int = Field(
        1,
        ge=1,
        description="Answers the policy may give; each wrong one but the last gets "
        "retry_message as the next user turn (episode.max_turns must allow as many).",
    )
    retry_message: str = Field("No. Try again.", min_length=1, description="The user's turn after a wrong answer.")
    retry_discount: float = Field(
        0.5,
        ge=0,
        le=1,
        description="The answer that ends the episode at try k (from 0) earns its reward times this ** k: "
        "answering at once is worth more than after being told.",
    )
    solved_at: float = Field(1.0, description="A reward at least this ends the episode as solved.")

    def build(self, rows: list[dict], reward_fn: Callable) -> Env:
        return SingleTurnEnv(
            rows,
            reward_fn,
            tries=self.tries,
            retry_message=self.retry_message,
            retry_discount=self.retry_discount,
            solved_at=self.solved_at,
        )


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
    VerifiersEnvConfig,
    default="single_turn",
)
