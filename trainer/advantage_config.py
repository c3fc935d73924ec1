"""The advantage estimators' configs: one model per estimator, tagged by ``type``, without torch.

Each holds only the knobs its estimator reads, so a misspelled estimator or a knob of another one
fails at load. Apart from ``trainer/advantages.py`` (the functions) so that loading a run config
does not import torch (see ``trainer/loss_config.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sample_buffer.registry import tagged_union


class BaseAdvantageConfig(BaseModel):
    """What every estimator shares: reward clipping before it, whitening after it."""

    model_config = ConfigDict(extra="forbid")

    reward_clip: float | None = Field(None, gt=0, description="Clip rewards to [-c, c] before estimating.")
    whiten: bool = Field(False, description="Whiten the advantages over all masked tokens of the batch.")
    eps: float = Field(1e-6, gt=0, description="Added to standard deviations.")


class GRPOAdvantageConfig(BaseAdvantageConfig):
    """GRPO: reward minus its group's mean, divided by the group's std."""

    type: Literal["grpo"] = Field("grpo", description="Selects GRPO.")
    norm_by_std: bool = Field(True, description="Divide by the group's reward std.")


class DrGRPOAdvantageConfig(BaseAdvantageConfig):
    """Dr. GRPO: reward minus its group's mean, no std division."""

    type: Literal["dr_grpo"] = Field("dr_grpo", description="Selects Dr. GRPO.")


class RLOOAdvantageConfig(BaseAdvantageConfig):
    """RLOO: reward minus the mean of the other members of its group."""

    type: Literal["rloo"] = Field("rloo", description="Selects RLOO.")


class ReinforcePPAdvantageConfig(BaseAdvantageConfig):
    """REINFORCE++: discounted returns whitened over the batch."""

    type: Literal["reinforce_pp"] = Field("reinforce_pp", description="Selects REINFORCE++.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of the returns.")


class GAEAdvantageConfig(BaseAdvantageConfig):
    """GAE over a critic's values (set ``trainer.critic: true``)."""

    type: Literal["gae"] = Field("gae", description="Selects GAE.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount.")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")


AdvantageConfig = tagged_union(
    GRPOAdvantageConfig,
    DrGRPOAdvantageConfig,
    RLOOAdvantageConfig,
    ReinforcePPAdvantageConfig,
    GAEAdvantageConfig,
    default="grpo",
)
"""One estimator's config, chosen by its ``type``; the key of ``ADVANTAGE_ESTIMATORS`` (trainer.advantages)."""
