"""Configuration of the reward service (``rollmesh serve reward``; the ``reward_service`` section)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout.config import RewardSpec
from rollout.rewards import resolve_reward


class RewardServiceConfig(BaseModel):
    """A RewardService: scores answers with one reward for every client that names it."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Address the gRPC server binds.")
    port: int = Field(50057, ge=0, le=65535, description="gRPC port (0: pick a free one).")
    metrics_port: int = Field(9107, ge=0, le=65535, description="Prometheus /metrics port; 0 disables it.")
    reward: RewardSpec = Field(
        "exact_match",
        description="What it scores with: a function's name in rollout.rewards or 'module:function' (run in "
        "`workers` processes), {type: code} (the sandbox) or {type: judge} (a judge model through an LLMProxy: "
        "the mesh's, mesh.proxy, unless the judge names its own; its tokenizer: the run's model_path unless "
        "it names one).",
    )
    workers: int = Field(
        2,
        ge=1,
        description="A function reward's worker processes: how many of its scores run at once (one that hangs "
        "or crashes is killed and replaced, and costs that score). The code reward's runs at once are "
        "reward.sandbox.max_concurrent; the judge's calls, reward.max_concurrent.",
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="The longest one score may take here, s; a caller's shorter timeout wins. Null: the reward's "
        "own bound (code and judge), 15 s for a function (its worker is killed past it).",
    )
    max_concurrent: int = Field(
        32, ge=1, description="Score calls being worked on at once (each holds a thread); more wait in line."
    )
    max_chars: int = Field(
        1_000_000, ge=1, description="A longer response or answer is refused (INVALID_ARGUMENT naming the field)."
    )

    @field_validator("reward")
    @classmethod
    def _a_reward_of_its_own(cls, reward: RewardSpec) -> RewardSpec:
        if isinstance(reward, str):
            resolve_reward(reward)  # a misspelled reward fails when the config is loaded
        elif reward.type == "service":
            raise ValueError(
                "a reward service scores with a reward of its own (a name, code or judge), not another service's"
            )
        return reward

    @model_validator(mode="after")
    def _bound(self) -> RewardServiceConfig:
        if self.timeout_s is None:
            self.timeout_s = 15.0 if isinstance(self.reward, str) else self.reward.max_seconds()
        return self
