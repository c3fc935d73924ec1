"""The reward service as a reward: each answer is scored by a RewardService (``rollmesh serve
reward``) instead of in the caller's process.

Why a service: RollPacker's reward scheduler scores each trajectory the moment it ends on a pool
of its own, so a CPU-heavy verifier (math-verify, a sandbox, a judge model) neither stalls the
EnvManager's event loop nor is duplicated in every EnvManager and environment provider; and one
pool means one set of adaptive-timeout anchors and one judge for the whole run.

The client is a plain callable ``(response, answer) -> float`` like every reward, built by the
``reward_service`` port that ``services/`` passes (``rollout/`` speaks no gRPC). A score that does
not come back within ``timeout_s`` (the service is down, busy, or its verifier hangs) is 0,
counted by cause; the run goes on.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

GRACE_S = 1.0  # past timeout_s, for the call's answer to come back


class ServiceRewardConfig(BaseModel):
    """``reward: {type: service}``: the reward service scores each answer."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["service"] = Field("service", description="Selects the reward service.")
    address: str | None = Field(
        None,
        description="host:port of the RewardService; null: the mesh's (mesh.reward, which `rollmesh run` starts "
        "with the reward_service section).",
    )
    timeout_s: float = Field(
        20.0,
        gt=0,
        description="One score, s (the service's wait for a free verifier included); past it the answer scores 0 "
        "(timeout). With its grace it must fit in episode.step_timeout_s.",
    )

    def max_seconds(self) -> float:
        """The longest one score can take."""
        return self.timeout_s + GRACE_S

    def build(self, reward_service=None, **_):
        """The reward; ``reward_service(config)`` builds the client where the mesh provides one."""
        if reward_service is None:
            raise ValueError(
                "reward.type service needs a client of the reward service: it is built by rollmesh's "
                "services (EnvManager, environment provider, held-out evaluation)"
            )
        return reward_service(self)
