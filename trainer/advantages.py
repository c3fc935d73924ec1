"""Advantage estimators: pure torch functions over padded batches.

Shapes: ``B`` trajectories padded to ``T`` tokens. ``mask`` [B, T] is 1 on the tokens the loss
sees (the policy's own tokens). Sequence-level rewards ``rewards`` [B] belong to the whole
trajectory; ``group_ids`` [B] (ints) say which trajectories share a prompt. Every function returns
token-level advantages [B, T] that are 0 where ``mask`` is 0, and the returns a critic regresses on
[B, T] (``None`` for the critic-free estimators): ``fn(rewards, mask, group_ids, *, values=None,
**knobs) -> (advantages, returns)``, the knobs being the fields of the estimator's own config.

Each estimator's config is its own model tagged by ``type`` (``advantages: {type: gae, lam: 0.95}``),
in ``trainer/advantage_config.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.advantage_config import AdvantageConfig


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over the masked entries (unbiased variance, as in PPO implementations)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    if n > 1:
        var = var * n / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def group_sums(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """For each row ([B]), the sum of ``values`` ([B]) over the rows of its group."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    k = int(inverse.max()) + 1 if len(inverse) else 0
    return torch.zeros(k, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)[inverse]


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-trajectory (group size, group sum, group std (unbiased)) of its group."""
    count, total = group_sums(torch.ones_like(rewards), group_ids), group_sums(rewards, group_ids)
    sq = group_sums((rewards - total / count) ** 2, group_ids)
    return count, total, torch.sqrt(sq / (count - 1).clamp(min=1))


def grpo(rewards, mask, group_ids, *, norm_by_std: bool = True, eps: float = 1e-6, **_) -> tuple:
    """GRPO: (r - group mean) / (group std + eps), broadcast to every masked token. No returns."""
    count, total, std = _group_stats(rewards, group_ids)
    adv = rewards - total / count
    if norm_by_std:
        adv = adv / (std + eps)
    return adv[:, None] * mask, None


def dr_grpo(rewards, mask, group_ids, **_) -> tuple:
    """Dr. GRPO: r - group mean; no std division (length normalisation is the loss's business)."""
    return grpo(rewards, mask, group_ids, norm_by_std=False)


def rloo(rewards, mask, group_ids, **_) -> tuple:
    """RLOO: r_i - mean of the other members of its group (0 for a group of one). No returns."""
    count, total, _ = _group_stats(rewards, group_ids)
    baseline = (total - rewards) / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, rewards - baseline, torch.zeros_like(rewards))
    return adv[:, None] * mask, None


def _token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A sequence reward placed on the last masked token: [B] → [B, T]."""
    if rewards.dim() == 2:
        return rewards * mask
    last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(dim=1)
    out = torch.zeros_like(mask, dtype=rewards.dtype)
    out[torch.arange(len(rewards)), last] = rewards
    return out * mask


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma G_{t+1} over masked tokens (unmasked tokens are skipped, not zeroed)."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype, device=token_rewards.device)
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        running = torch.where(m > 0, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running * m
    return returns


def reinforce_pp(rewards, mask, group_ids=None, *, gamma: float = 1.0, eps: float = 1e-6, **_) -> tuple:
    """REINFORCE++: discounted returns whitened over the whole batch (a global baseline). No returns
    for a critic: the baseline is the batch mean."""
    returns = discounted_returns(_token_rewards(rewards, mask), mask, gamma)
    return masked_whiten(returns, mask, eps), None


def gae(rewards, mask, group_ids=None, *, values=None, gamma: float = 1.0, lam: float = 1.0, **_) -> tuple:
    """Generalised advantage estimation with a critic's ``values`` [B, T].

    delta_t = r_t + gamma V_{t+1} - V_t; A_t = delta_t + gamma lam A_{t+1}, over masked tokens
    (V after the last one is 0). Returns (advantages, returns = A + V), both masked.
    """
    if values is None:
        raise ValueError("advantages.type 'gae' needs a critic's values: set trainer.critic: true")
    token_rewards = _token_rewards(rewards, mask)
    adv = torch.zeros_like(token_rewards)
    next_value = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype, device=token_rewards.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a * m
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, a, next_adv)
    return adv, (adv + values) * mask


ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "gae": gae,
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
}


def compute_advantages(
    config: AdvantageConfig, rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, values=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply reward clipping, the estimator ``config.type`` and optional whitening; returns
    (advantages [B, T], returns [B, T] for a critic or None)."""
    if config.reward_clip is not None:
        rewards = rewards.clamp(-config.reward_clip, config.reward_clip)
    mask = mask.to(rewards.dtype)
    knobs = config.model_dump(exclude={"type", "reward_clip", "whiten"})
    adv, returns = ADVANTAGE_ESTIMATORS[config.type](rewards, mask, group_ids, values=values, **knobs)
    if config.whiten:
        adv = masked_whiten(adv, mask, config.eps)
    return adv, returns
