"""The policy losses' configs: one model per variant, tagged by ``type``, without torch.

Each variant's config holds only the knobs that variant reads, so a knob of another variant, or a
misspelled one, fails when the config is loaded instead of being silently ignored. The knobs keep
their variant prefix (``gspo_clip_low``, ``tis_cap``) because the same word with another scale is a
trap: GSPO's sequence ratio clips at 3e-4 where PPO's token ratio clips at 0.2, and switching
``type`` while keeping ``clip_low`` should be an error, not a clip hundreds of times wider.

Apart from ``trainer/losses.py`` (the functions) so that loading a run config does not import torch:
every service reads the whole config, and torch's import was most of a restarted service's start.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sample_buffer.registry import resolve, tagged_union

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
OldPolicy = Literal["behavior", "proximal"]


def _old_policy_field() -> Any:
    return Field(
        "behavior",
        description="The policy the ratio π_θ/π_old is taken against. behavior: μ, the engine's log-probs of "
        "the sampled tokens, i.e. the policy that sampled them, as the papers write it (corrects for staleness). "
        "proximal: π_prox, the trainer's weights at the start of this step (the ratio is 1 at the first "
        "mini-batch and moves only with this step's own updates: no staleness correction).",
    )


class BaseLossConfig(BaseModel):
    """What every policy loss shares: how the per-token loss matrix becomes one number."""

    model_config = ConfigDict(extra="forbid")

    agg_mode: AggMode = Field("token-mean", description="How the per-token loss matrix becomes one number.")
    norm_len: int | None = Field(
        None, ge=1, description="seq-mean-token-sum-norm: the constant length divided by (default: T)."
    )


class _RatioClipConfig(BaseLossConfig):
    """The token-ratio clip range of PPO and decoupled PPO."""

    clip_low: float = Field(0.2, ge=0, description="ε_low: ratio clipped below at 1 - ε_low.")
    clip_high: float = Field(0.28, ge=0, description="ε_high: ratio clipped above at 1 + ε_high (DAPO clip-higher).")


class PPOLossConfig(_RatioClipConfig):
    """PPO's clipped surrogate on π/π_old, with optional dual clip; π_old is μ unless ``old_policy``."""

    type: Literal["ppo"] = Field("ppo", description="Selects PPO.")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip constant c (> 1) for negative advantages.")
    old_policy: OldPolicy = _old_policy_field()


class GSPOLossConfig(BaseLossConfig):
    """GSPO: the clipped surrogate on the per-sequence geometric-mean ratio."""

    type: Literal["gspo"] = Field("gspo", description="Selects GSPO.")
    gspo_clip_low: float = Field(3e-4, ge=0, description="Sequence-ratio clip below at 1 - this.")
    gspo_clip_high: float = Field(4e-4, ge=0, description="Sequence-ratio clip above at 1 + this.")
    old_policy: OldPolicy = _old_policy_field()


class DecoupledPPOLossConfig(_RatioClipConfig):
    """Decoupled PPO (AReaL): clip π/π_prox, weight by sg(π_prox/μ): both policies, fixed. The default loss."""

    type: Literal["decoupled_ppo"] = Field("decoupled_ppo", description="Selects decoupled PPO.")
    behavior_weight_cap: float | None = Field(5.0, gt=0, description="Cap of the π_prox/μ weight (None = uncapped).")


class TISLossConfig(BaseLossConfig):
    """Truncated importance sampling against the behaviour policy."""

    type: Literal["tis"] = Field("tis", description="Selects truncated IS.")
    tis_cap: float = Field(2.0, gt=0, description="Truncation c of the importance weight min(π/π_old, c).")
    old_policy: OldPolicy = _old_policy_field()


class CISPOLossConfig(BaseLossConfig):
    """CISPO: REINFORCE weighted by the clipped (stop-gradient) ratio."""

    type: Literal["cispo"] = Field("cispo", description="Selects CISPO.")
    cispo_clip_low: float = Field(1.0, ge=0, description="ε_low of the clipped weight (1.0 = no lower clip).")
    cispo_clip_high: float = Field(0.28, ge=0, description="ε_high of the clipped weight.")
    old_policy: OldPolicy = _old_policy_field()


class TOPRLossConfig(BaseLossConfig):
    """TOPR: REINFORCE on positive advantages, truncated IS on negative ones."""

    type: Literal["topr"] = Field("topr", description="Selects TOPR.")
    topr_pos_coef: float = Field(1.0, ge=0, description="Coefficient of positive-advantage samples.")
    topr_neg_coef: float = Field(1.0, ge=0, description="Coefficient of negative-advantage samples.")
    old_policy: OldPolicy = _old_policy_field()


class ReinforceLossConfig(BaseLossConfig):
    """Plain REINFORCE: -A·log π, no ratio, no knobs."""

    type: Literal["reinforce"] = Field("reinforce", description="Selects REINFORCE.")


class CustomLossConfig(BaseLossConfig):
    """A user's own loss with the signature of the variants below; it reads its knobs from ``params``."""

    type: Literal["custom"] = Field("custom", description="Selects a user's own loss function.")
    function: str = Field(
        ..., description="'module:function' of the loss; called like the built-in variants, with config=this."
    )
    params: dict[str, Any] = Field(
        default_factory=dict, description="Knobs of your own loss, read by it as config.params[...]."
    )

    @field_validator("function")
    @classmethod
    def _importable(cls, name: str) -> str:
        if ":" not in name:
            raise ValueError(f"expected 'module:function', got {name!r}")
        if not callable(resolve("function", name, {})):
            raise ValueError(f"{name!r} is not callable")
        return name


PolicyLossConfig = tagged_union(
    PPOLossConfig,
    GSPOLossConfig,
    DecoupledPPOLossConfig,
    TISLossConfig,
    CISPOLossConfig,
    TOPRLossConfig,
    ReinforceLossConfig,
    CustomLossConfig,
    default="decoupled_ppo",
)
"""One of the variants' configs, chosen by its ``type``; the key of ``trainer.losses.POLICY_LOSSES`` that runs it."""


def sees_behavior(loss) -> bool:
    """Does the loss weight samples by the behaviour policy μ (through its ratio or a weight)?"""
    return loss.type == "decoupled_ppo" or getattr(loss, "old_policy", None) == "behavior"


class NoMismatchCorrection(BaseModel):
    """No correction for the trainer and the engine computing different log-probs of one token.
    (A correction applies to losses whose ratio is against π_prox: one against μ holds π_prox/μ
    already, and the config refuses the pair.)"""

    model_config = ConfigDict(extra="forbid")

    type: Literal["none"] = Field("none", description="Selects no correction (the default).")


class TruncatedMismatchCorrection(BaseModel):
    """Weight each token's loss by sg(min(π_prox/μ, cap)): truncated importance sampling from the
    engine's numerics to the trainer's (Yao et al., 2025: "your efficient RL framework secretly
    brings you off-policy RL training")."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["truncate"] = Field("truncate", description="Selects truncated importance weights.")
    cap: float = Field(2.0, gt=0, description="Truncation C of the weight min(π_prox/μ, C).")


class MaskedMismatchCorrection(BaseModel):
    """Drop from the loss every token whose π_prox/μ falls outside [low, high] (IcePop-style
    masking): a token the two sides disagree on that much carries a broken gradient."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["mask"] = Field("mask", description="Selects masking of mismatched tokens.")
    low: float = Field(0.5, gt=0, description="α: tokens with π_prox/μ below this get weight 0.")
    high: float = Field(2.0, gt=0, description="β: tokens with π_prox/μ above this get weight 0.")

    @model_validator(mode="after")
    def _ordered(self) -> MaskedMismatchCorrection:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self


MismatchCorrection = tagged_union(
    NoMismatchCorrection, TruncatedMismatchCorrection, MaskedMismatchCorrection, default="none"
)
"""How the loss corrects for the train/inference log-prob mismatch, chosen by ``type``."""
