"""Per-token losses a client names (the Tinker training API's ``loss_fn``), as pure functions.

Each takes the learner's log-probs of one datum's target tokens (``lp``, [N] or [N, K], with
gradient), that datum's ``inputs`` (``loss_fn_inputs``: tensors of the same leading length) and
the call's ``config`` (``loss_fn_config``), and returns the datum's loss, a **sum** over its
tokens (not a mean: the client weighs tokens itself, e.g. ``weights`` summing to 1 per example).
Where ``q`` (the sampler's log-probs) appears, the ratio is π/q of each sampled token.

Unlike ``trainer/losses.py`` (rollmesh's own losses over whole batches, with their proximal
policies and normalizations), these are exactly what the caller asked for, token by token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Inputs = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, Inputs, dict[str, float]], torch.Tensor]


class LossInputError(ValueError):
    """A loss's input is missing or of the wrong shape; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def _need(inputs: Inputs, key: str, n: int) -> torch.Tensor:
    t = inputs.get(key)
    if t is None:
        raise LossInputError(f"loss_fn_inputs.{key}", "required by this loss")
    if t.shape[0] != n:
        raise LossInputError(f"loss_fn_inputs.{key}", f"{t.shape[0]} values for {n} input tokens")
    return t.float()


def cross_entropy(lp: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    """−Σ weights · log π(target): supervised learning (weights 0 on the prompt)."""
    weights = _need(inputs, "weights", lp.shape[0])
    if weights.shape != lp.shape:
        raise LossInputError("loss_fn_inputs.weights", f"shape {tuple(weights.shape)}, targets {tuple(lp.shape)}")
    return -(lp * weights).sum()


def _ratio(lp: torch.Tensor, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    q = _need(inputs, "logprobs", lp.shape[0])
    adv = _need(inputs, "advantages", lp.shape[0])
    return torch.exp(lp - q), adv


def importance_sampling(lp: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    """−Σ (π/q) · A: the policy gradient corrected for sampling with q."""
    ratio, adv = _ratio(lp, inputs)
    return -(ratio * adv).sum()


def _clip_range(config: dict[str, float]) -> tuple[float, float]:
    return config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)


def ppo(lp: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    """−Σ min(r · A, clip(r, low, high) · A), r = π/q (PPO's clipped objective; ε = 0.2 by default)."""
    ratio, adv = _ratio(lp, inputs)
    low, high = _clip_range(config)
    return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv).sum()


def cispo(lp: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    """−Σ sg(clip(r, low, high)) · log π · A: the clipped ratio weighs, every token keeps a gradient."""
    ratio, adv = _ratio(lp, inputs)
    low, high = _clip_range(config)
    return -(ratio.clamp(low, high).detach() * lp * adv).sum()


def dro(lp: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    """−Σ (log π · A − β/2 · (log π − q)²): a policy gradient with a quadratic pull towards q."""
    q = _need(inputs, "logprobs", lp.shape[0])
    adv = _need(inputs, "advantages", lp.shape[0])
    beta = config.get("beta", 0.05)
    return -(lp * adv - 0.5 * beta * (lp - q) ** 2).sum()


def gspo(lp: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    """GSPO-token: PPO's clipped objective on the sequence's ratio s, the geometric mean of π/q over
    the tokens ``sequence_ratio_mask`` marks; each token carries s's value and its own log π's
    gradient (s_t = sg[s] · π/sg[π]), so per-token advantages still work."""
    q = _need(inputs, "logprobs", lp.shape[0])
    adv = _need(inputs, "advantages", lp.shape[0])
    mask = _need(inputs, "sequence_ratio_mask", lp.shape[0]) != 0
    if not mask.any():  # the mean over no token: NaN in every gradient
        raise LossInputError("loss_fn_inputs.sequence_ratio_mask", "marks no token; the sequence ratio needs one")
    log_s = (lp.detach() - q)[mask].mean()
    ratio = torch.exp(log_s + lp - lp.detach())
    low, high = _clip_range(config)
    return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv).sum()


# What each loss reads from ``loss_fn_inputs`` besides target_tokens: checked for every datum before
# any is computed, so a bad call adds no gradient at all.
NEEDS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages", "sequence_ratio_mask"),
}


def _gspo_inputs(target: torch.Tensor, inputs: Inputs) -> None:
    """GSPO's ratio is a sequence's: one target per position, and a mask that marks a token."""
    if target.dim() != 1:
        raise LossInputError("loss_fn_inputs.target_tokens", "gspo takes one target per position, not [N, K]")
    if not bool((inputs["sequence_ratio_mask"] != 0).any()):
        raise LossInputError("loss_fn_inputs.sequence_ratio_mask", "marks no token; the sequence ratio needs one")


def check_config(config: dict[str, float]) -> None:
    """A call's ``loss_fn_config``: every number finite (a NaN clip bound or β makes every gradient of
    the call NaN, and the adapter's weights after its optim_step), a clip range that is one."""
    for key, v in config.items():
        if not math.isfinite(v):
            raise LossInputError(f"loss_fn_config.{key}", f"{v!r}: a finite number")
    low, high = _clip_range(config)
    if not 0 <= low <= high:
        raise LossInputError("loss_fn_config", f"clip thresholds {low}, {high}: 0 <= clip_low <= clip_high")


# What a loss asks of a datum beyond NEEDS (its inputs present, shaped as the targets, finite),
# checked with them: a datum that would fail midway fails before any gradient is added.
CHECKS: dict[str, Callable[[torch.Tensor, Inputs], None]] = {"gspo": _gspo_inputs}

LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}
