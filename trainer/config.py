"""Configuration of the trainer."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.advantage_config import AdvantageConfig, GRPOAdvantageConfig
from trainer.lora import LoraConfig
from trainer.loss_config import (
    DecoupledPPOLossConfig,
    MismatchCorrection,
    NoMismatchCorrection,
    PolicyLossConfig,
    sees_behavior,
)


class TrainLoopConfig(BaseModel):
    """The loop around the training engine: run length, batches, deadlines, checkpoints."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(100, ge=1, description="Optimizer steps of the run (also the LR schedule's length).")
    run_dir: str = Field("runs/default", description="Checkpoints, exported weights and metrics.jsonl go here.")
    checkpoint_every: int = Field(20, ge=0, description="Checkpoint every k steps and at the end; 0 = never.")
    get_timeout_s: float = Field(120.0, gt=0, description="How long one step waits for a full batch of groups.")
    publish_timeout_s: float = Field(120.0, gt=0, description="Deadline of one weight update on the engines.")
    keep_weight_versions: int = Field(2, ge=1, description="Exported weight versions kept (rollback needs >= 1).")


class MixedPrecisionConfig(BaseModel):
    """Compute in a lower precision while the optimizer keeps float32 master weights: FSDP2's
    ``MixedPrecisionPolicy`` under torchrun (parameters cast for forward and backward, gradients
    reduced in ``reduce_dtype``); ``torch.autocast`` in a single process."""

    model_config = ConfigDict(extra="forbid")

    param_dtype: Literal["bfloat16", "float16"] = Field("bfloat16", description="Dtype of forward and backward.")
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype gradients are reduced in across ranks (float32: no precision lost summing)."
    )


class DistillConfig(BaseModel):
    """On-policy distillation (trainer/distillation.py): how a teacher's log-probs of the sampled
    tokens enter the advantage, Â = reward_coef·A − coef·(log π − log π_T − b), and, where the teacher
    sent its top-k tokens (env_manager.teacher_top_k), the loss gains top_k_coef · KL(p̃_T ‖ π) over them.
    Applies to every trajectory a teacher scored; the others train on their reward alone."""

    model_config = ConfigDict(extra="forbid")

    coef: float = Field(
        0.1,
        ge=0,
        description="λ: weight of the per-token gap to the teacher. A sampled token's gap is nats where the two "
        "disagree; at 1 it outweighed the reward's advantage on the digit task and pushed probability off the "
        "answers altogether (docs/distillation.md).",
    )
    reward_coef: float = Field(
        1.0,
        ge=0,
        description="Weight of the verifiable reward's advantage on taught tokens (0: distillation alone).",
    )
    baseline: Literal["group", "none"] = Field(
        "group",
        description="group: the gap log π − log π_T minus its mean over the group's tokens (a baseline, nearly "
        "unbiased, that lowers the estimate's variance); none: the gap as it is (slime's form).",
    )
    top_k_coef: float = Field(
        1.0,
        ge=0,
        description="Weight of the top-k forward KL, KL(p̃_T ‖ π) per taught token over the teacher's k most likely "
        "tokens (p̃_T: their probabilities renormalised), summed over taught tokens and divided by all the "
        "update's tokens, as the policy loss's token mean is (a batch half taught weighs it half). A dense signal "
        "at every position, not only at the sampled token: what a one-token answer needs. Used where the rollout "
        "asked for them (env_manager.teacher_top_k > 0).",
    )
    student: Literal["behavior", "proximal"] = Field(
        "behavior",
        description="The student's log π in the gap: behavior, the engine's log-prob μ of the sampled token (what "
        "sampled it; free); proximal, the trainer's π_prox at the step's start (one more forward pass a step).",
    )


class MoEConfig(BaseModel):
    """Mixture-of-experts models (trainer/routing.py)."""

    model_config = ConfigDict(extra="forbid")

    routing: Literal["free", "replay"] = Field(
        "free",
        description="free: the trainer's routers pick their own experts. replay (rollout routing replay, R3): "
        "each token goes to the experts the engine routed it to (recorded with every trajectory), gates "
        "recomputed by the model's own router over those experts, for the policy, π_prox and the reference "
        "model; a trajectory without complete routing is not trained on (counted: routing_dropped). Needs an "
        "MoE model and an engine that reports routing (embedded, sglang).",
    )


class TrainerConfig(BaseModel):
    """The training engine: model, optimiser, batching, loss terms, checkpoints."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["fsdp"] = Field("fsdp", description="Train the model with FSDP2 (the default).")

    model_path: str | None = Field(
        None, description="Local Hugging Face model directory to start from; default: the run's model_path."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' picks cuda when available.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype of the parameters the optimizer updates (keep float32 with mixed_precision)."
    )
    mixed_precision: MixedPrecisionConfig | None = Field(
        None,
        description="Train in bfloat16 (or float16) with float32 master weights and reductions; None: all in "
        "`dtype`. On GPU: mixed_precision: {} (bfloat16 compute, float32 reduction).",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass: less memory for "
        "long sequences, about a third more compute.",
    )
    seed: int = Field(0, description="Seed of torch's generators.")
    num_threads: int = Field(
        0,
        ge=0,
        description="torch intra-op CPU threads; 0: `rollmesh run` gives each torch process it starts an "
        "equal share of the cores (torch's default elsewhere: every core, which a neighbour process slows down).",
    )
    lr: float = Field(1e-5, gt=0, description="Peak learning rate of AdamW.")
    vision_lr: float | None = Field(
        None,
        gt=0,
        description="A vision-language policy's vision tower and projector: their peak learning rate (None: "
        "lr). A tower learning new pictures may need a larger one than the language model stays stable at.",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up from 0 to lr over this many optimizer steps.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="Shape after warm-up; cosine reaches 0 at the run's last step (train_loop.steps)."
    )
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the global gradient norm to this (None = off).")
    micro_batch_tokens: int = Field(
        8192, ge=1, description="Tokens per micro-batch (one forward/backward); gradients accumulate over them."
    )
    pack_sequences: bool = Field(
        False,
        description="Pack a micro-batch's trajectories into one row: each attends only to itself through "
        "variable-length attention (trainer/varlen.py), so no token is padding and no dense mask is built.",
    )
    tree_packing: bool = Field(
        False,
        description="With pack_sequences: tokens that trajectories share from their start (a group's prompt, an "
        "agent session's history up to a fork) are computed once, in a prefix tree rebuilt from the token ids "
        "(trainer/prefix_tree.py), and micro-batches keep a group whole. Equal to flat packing to float error; "
        "text policies without routing replay.",
    )
    advantages: AdvantageConfig = Field(
        default_factory=GRPOAdvantageConfig,
        description="Advantage estimation, chosen by 'type' (grpo | dr_grpo | rloo | reinforce_pp | gae) with its "
        "own knobs.",
    )
    loss: PolicyLossConfig = Field(
        default_factory=DecoupledPPOLossConfig,
        description="The policy loss, chosen by 'type' (ppo | gspo | decoupled_ppo | tis | cispo | topr | reinforce "
        "| custom) with its own knobs.",
    )
    mismatch: MismatchCorrection = Field(
        default_factory=NoMismatchCorrection,
        description="Correction for the engine's log-probs μ differing from the trainer's π_prox for the same "
        "weights, chosen by 'type' (none | truncate | mask). Off by default: the step metrics "
        "mismatch_fresh_mean/max show how large it is first.",
    )
    ppo_epochs: int = Field(1, ge=1, description="Passes over each step's batch (PPO epochs).")
    mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per pass: the batch's groups split into this many slices of whole groups, "
        "so the ratio moves within a step and a clip can bind. The policy version still advances once per step.",
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="Entropy bonus coefficient (0 = off). Mind Adam: the bonus pushes up the logits of "
        "tokens the policy never samples with gradients too small to matter, which Adam scales to full "
        "learning-rate steps; at 0.05 the quickstart's tiny model (tied embeddings) went uniform over its "
        "vocabulary within two steps in 3 runs of 6.",
    )
    ref_model_path: str | None = Field(None, description="Frozen reference model for a KL term (None = no KL).")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the reference policy.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator (Schulman's k1/k2/k3).")
    kl_in_reward: bool = Field(False, description="Subtract the KL from the rewards instead of adding a loss term.")
    distill: DistillConfig = Field(
        default_factory=DistillConfig,
        description="On-policy distillation: how the log-probs a teacher gave the sampled tokens enter the advantage.",
    )
    critic: bool = Field(False, description="Train a value model (needed by the 'gae' estimator).")
    critic_lr: float = Field(1e-5, gt=0, description="Learning rate of the critic.")
    value_clip: float | None = Field(0.2, gt=0, description="Clip range of the critic's value loss.")
    max_step_kl: float | None = Field(
        None,
        gt=0,
        description="Trust region of a step (None = off): after its updates, if KL(π_prox ‖ π_new), estimated (k3) "
        "over the batch's generated tokens (sampled by μ), exceeds this, the weights are pulled back halfway to "
        "π_prox, up to 6 times. Bounds the rare steps that move the policy by nats at once "
        "(docs/losses.md#staleness); costs one forward pass a step, one more per halving, and a copy of the "
        "weights; single-process trainers only.",
    )
    moe: MoEConfig = Field(default_factory=MoEConfig, description="Mixture-of-experts models: routing replay.")
    lora: LoraConfig | None = Field(
        None,
        description="Train low-rank adapters instead of every weight (None = full fine-tuning): the base stays "
        "frozen, checkpoints hold the adapters (also in PEFT's format, step_N/adapter), the engines get the "
        "adapters merged into the weights, and a reference model at model_path is this one with its adapters "
        "off. Not with vision-language policies, moe.routing replay, audit_versions or max_step_kl yet.",
    )
    audit_versions: int = Field(
        0,
        ge=0,
        description="Diagnostic (0 = off): keep CPU copies of the last N versions' weights and report each step "
        "policy_kl_1..N, the full-vocabulary KL(π_v ‖ π_{v−k}) at the batch's generated positions (how far the "
        "policy moved in k steps), and audit_mu_err_*, |log π_u(token) − μ| with the weights of the version u each "
        "token is tagged with (is μ the policy it says). N copies of the weights, up to N + 1 extra forward passes "
        "a step, and one more model on the trainer's device to run them; single-process trainers only "
        "(trainer/audit.py).",
    )

    @model_validator(mode="after")
    def _one_correction_per_ratio(self) -> TrainerConfig:
        # A ratio against μ already holds π_prox/μ (and decoupled PPO weights by it): a mismatch
        # weight on top would correct twice, and on stale tokens compound the drift as well.
        if self.mismatch.type != "none" and sees_behavior(self.loss):
            raise ValueError(
                f"mismatch: {self.mismatch.type!r} corrects π_prox/μ, which loss {self.loss.type!r} already takes "
                "into account; use it with old_policy: proximal (or reinforce / custom)"
            )
        return self

    @model_validator(mode="after")
    def _tree_packing_packs(self) -> TrainerConfig:
        if self.tree_packing and not self.pack_sequences:
            raise ValueError("tree_packing: needs pack_sequences: true (a tree is a packed row)")
        if self.tree_packing and self.moe.routing == "replay":
            # replayed experts are laid out per sequence, and a shared prefix has no single sequence
            raise ValueError("tree_packing: not with moe.routing 'replay' yet (set one of them off)")
        if self.audit_versions and self.pack_sequences:
            # the audit forwards its older weights unpacked, through the model's packed attention
            raise ValueError("audit_versions: not with pack_sequences yet (set pack_sequences and tree_packing off)")
        return self

    @model_validator(mode="after")
    def _master_weights_are_wider(self) -> TrainerConfig:
        if self.mixed_precision is not None and self.dtype != "float32":
            raise ValueError(
                f"dtype: {self.dtype!r} with mixed_precision leaves no float32 master weights (keep "
                "dtype: float32; mixed_precision sets the compute dtype)"
            )
        return self

    @model_validator(mode="after")
    def _critic_goes_with_gae(self) -> TrainerConfig:
        # GAE needs a value model's estimates; every other estimator ignores one (its loss would have no returns).
        if (self.advantages.type == "gae") != self.critic:
            raise ValueError("critic: must be true exactly when advantages.type is 'gae' (GAE needs a value model)")
        return self
