"""The policy-loss family, KL and entropy terms, and the critic's value loss: pure functions.

Shapes: ``[B, T]`` per-token tensors, ``mask`` 1 on the tokens the loss counts. Every variant is
``fn(logprobs, old_logprobs, advantages, mask, *, config, behavior_logprobs, proximal_logprobs)``
and returns the per-token loss matrix, its ratio and where it clipped; ``policy_loss`` picks
``old_logprobs``, adds the aggregation and the metrics. Log-probs:

- ``logprobs``: the current policy π_θ (carries the gradient);
- ``behavior_logprobs``: what the inference engine reported when it sampled the token (μ): the
  policy that sampled it, possibly versions ago, through the engine's numerics;
- ``proximal_logprobs``: π_prox, the trainer's weights at the start of the step, recomputed;
- ``old_logprobs``: the ratio's denominator π_old, μ or π_prox as the variant's ``old_policy``
  says (``old_logprobs_for``). With μ the ratio corrects for staleness; with π_prox it is 1 at
  the step's first mini-batch and only measures the step's own updates.

Each variant's config is its own model tagged by ``type`` (``loss: {type: ppo, dual_clip: 3}``), in
``trainer/loss_config.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from sample_buffer.registry import resolve
from trainer.advantages import masked_mean
from trainer.loss_config import (
    AggMode,
    CISPOLossConfig,
    CustomLossConfig,
    DecoupledPPOLossConfig,
    GSPOLossConfig,
    MismatchCorrection,
    PolicyLossConfig,
    PPOLossConfig,
    ReinforceLossConfig,
    TISLossConfig,
    TOPRLossConfig,
)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: AggMode, norm_len: int | None = None) -> torch.Tensor:
    """Reduce a [B, T] loss matrix. Sequence means skip sequences with no masked token."""
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum().clamp(min=1)
    seq_tokens = mask.sum(-1)
    valid = (seq_tokens > 0).to(loss.dtype)
    n_seq = valid.sum().clamp(min=1)
    if mode == "seq-mean-token-sum":
        return ((loss * mask).sum(-1) * valid).sum() / n_seq
    if mode == "seq-mean-token-mean":
        return ((loss * mask).sum(-1) / seq_tokens.clamp(min=1) * valid).sum() / n_seq
    if mode == "seq-mean-token-sum-norm":
        return (loss * mask).sum() / (n_seq * (norm_len or loss.shape[-1]))
    raise ValueError(f"agg_mode: unknown {mode!r}")


def _clip_frac(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Where the clipped term is the one taken (the gradient is cut)."""
    return ((ratio > 1 + high) & (adv > 0)) | ((ratio < 1 - low) & (adv < 0))


def ppo(logprobs, old_logprobs, advantages, mask, *, config: PPOLossConfig, **_):
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
    loss = torch.maximum(-advantages * ratio, -advantages * clipped)
    if config.dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * config.dual_clip), loss)
    return loss, ratio, _clip_frac(ratio, advantages, config.clip_low, config.clip_high)


def gspo(logprobs, old_logprobs, advantages, mask, *, config: GSPOLossConfig, **_):
    """GSPO: s_i = exp(mean_t log(π/π_old)) per sequence, clipped at the sequence level. Written
    in its token form s_i,t = sg(s_i)·π_t/sg(π_t), whose value and gradient equal the sequence
    form's when the advantage is constant over a sequence."""
    log_seq_ratio = masked_mean(logprobs - old_logprobs, mask, dim=-1)
    ratio = torch.exp(logprobs - logprobs.detach() + log_seq_ratio.detach()[:, None])
    clipped = torch.clamp(ratio, 1 - config.gspo_clip_low, 1 + config.gspo_clip_high)
    loss = torch.maximum(-advantages * ratio, -advantages * clipped)
    return loss, ratio, _clip_frac(ratio, advantages, config.gspo_clip_low, config.gspo_clip_high)


def decoupled_ppo(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    config: DecoupledPPOLossConfig,
    behavior_logprobs=None,
    proximal_logprobs=None,
    **_,
):
    """Decoupled PPO (AReaL): clip π/π_prox, weight the whole term by sg(π_prox/μ)."""
    if behavior_logprobs is None:
        raise ValueError("decoupled_ppo needs behavior_logprobs (the engine's log-probs)")
    prox = old_logprobs if proximal_logprobs is None else proximal_logprobs
    ratio = torch.exp(logprobs - prox)
    clipped = torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
    weight = torch.exp(prox - behavior_logprobs).detach()
    if config.behavior_weight_cap is not None:
        weight = weight.clamp(max=config.behavior_weight_cap)
    loss = weight * torch.maximum(-advantages * ratio, -advantages * clipped)
    return loss, ratio, _clip_frac(ratio, advantages, config.clip_low, config.clip_high)


def tis(logprobs, old_logprobs, advantages, mask, *, config: TISLossConfig, **_):
    """Truncated IS: -sg(min(π/π_old, c))·A·log π, π_old = μ by default."""
    ratio = torch.exp(logprobs - old_logprobs)
    weight = torch.clamp(ratio, max=config.tis_cap).detach()
    return -weight * advantages * logprobs, ratio, ratio > config.tis_cap


def cispo(logprobs, old_logprobs, advantages, mask, *, config: CISPOLossConfig, **_):
    """CISPO: -sg(clip(π/π_old, 1-ε_low, 1+ε_high))·A·log π (the weight is clipped, never the gradient)."""
    ratio = torch.exp(logprobs - old_logprobs)
    weight = torch.clamp(ratio, 1 - config.cispo_clip_low, 1 + config.cispo_clip_high).detach()
    clipped = (ratio > 1 + config.cispo_clip_high) | (ratio < 1 - config.cispo_clip_low)
    return -weight * advantages * logprobs, ratio, clipped


def topr(logprobs, old_logprobs, advantages, mask, *, config: TOPRLossConfig, **_):
    """TOPR: plain REINFORCE on A >= 0; truncated IS sg(min(π/π_old, 1)) on A < 0, π_old = μ by default."""
    ratio = torch.exp(logprobs - old_logprobs)
    neg_weight = torch.clamp(ratio, max=1.0).detach()
    pos = -config.topr_pos_coef * advantages * logprobs
    neg = -config.topr_neg_coef * neg_weight * advantages * logprobs
    return torch.where(advantages >= 0, pos, neg), ratio, (advantages < 0) & (ratio > 1)


def reinforce(logprobs, old_logprobs, advantages, mask, *, config: ReinforceLossConfig, **_):
    ratio = torch.exp(logprobs - old_logprobs)
    return -advantages * logprobs, ratio, torch.zeros_like(ratio, dtype=torch.bool)


def custom(logprobs, old_logprobs, advantages, mask, *, config: CustomLossConfig, **kw):
    """A user's own loss, ``config.function``, called with the same arguments (import checked at load)."""
    fn = resolve("function", config.function, {})
    return fn(logprobs, old_logprobs, advantages, mask, config=config, **kw)


POLICY_LOSSES: dict[str, Callable] = {
    "ppo": ppo,
    "gspo": gspo,
    "decoupled_ppo": decoupled_ppo,
    "tis": tis,
    "cispo": cispo,
    "topr": topr,
    "reinforce": reinforce,
    "custom": custom,
}
"""Every variant by its config's ``type``; the configs in ``trainer/loss_config.py`` are the other half."""


def old_logprobs_for(config: PolicyLossConfig, behavior: torch.Tensor, proximal: torch.Tensor) -> torch.Tensor:
    """The denominator π_old of the variant's ratio: μ or π_prox as its ``old_policy`` says.
    Decoupled PPO takes both (π_prox here, μ in its weight); REINFORCE has no ratio (π_prox, for
    the metrics); a custom loss gets π_prox as ``old_logprobs`` and both by name."""
    return behavior if getattr(config, "old_policy", "proximal") == "behavior" else proximal


def policy_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    behavior_logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    entropy: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    stale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Aggregated loss of the variant ``config.type`` and its metrics.

    ``token_weights`` (a mismatch correction's, no gradient) scale each token's loss. Metrics:
    clip fraction, the variant's ratio π/π_old (mean, max) and approx KL to π_old, and the ratio
    against each policy whatever the variant uses (``ratio_behavior_mean`` π/μ,
    ``ratio_proximal_mean`` π/π_prox). Where ``stale`` marks tokens sampled by older weights
    than π_prox, the same over those alone (``*_stale``, with ``stale_tokens``)."""
    old_logprobs = old_logprobs_for(config, behavior_logprobs, proximal_logprobs)
    per_token, ratio, clipped = POLICY_LOSSES[config.type](
        logprobs,
        old_logprobs,
        advantages,
        mask,
        config=config,
        behavior_logprobs=behavior_logprobs,
        proximal_logprobs=proximal_logprobs,
    )
    if token_weights is not None:
        per_token = per_token * token_weights
    loss = aggregate(per_token, mask, config.agg_mode, config.norm_len)
    with torch.no_grad():
        metrics = _ratio_metrics(
            logprobs, old_logprobs, behavior_logprobs, proximal_logprobs, ratio, clipped, mask.bool()
        )
        if stale is not None and (m := mask.bool() & stale.bool()).any():
            sub = _ratio_metrics(logprobs, old_logprobs, behavior_logprobs, proximal_logprobs, ratio, clipped, m)
            metrics |= {f"{k}_stale": v for k, v in sub.items()} | {"stale_tokens": float(m.sum())}
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy, mask).item()
    return loss, metrics


RATIO_METRICS = ("clip_frac", "ratio_mean", "ratio_max", "approx_kl", "ratio_behavior_mean", "ratio_proximal_mean")
"""The metrics ``policy_loss`` reports over all tokens, and with ``_stale`` over stale ones."""


def _ratio_metrics(logprobs, old, behavior, proximal, ratio, clipped, m: torch.Tensor) -> dict[str, float]:
    if not m.any():
        return {
            "clip_frac": 0.0,
            "ratio_mean": 1.0,
            "ratio_max": 1.0,
            "approx_kl": 0.0,
            "ratio_behavior_mean": 1.0,
            "ratio_proximal_mean": 1.0,
        }
    log_ratio = (logprobs - old)[m]
    return {
        "clip_frac": clipped[m].float().mean().item(),
        "ratio_mean": ratio[m].mean().item(),
        "ratio_max": ratio[m].max().item(),
        # k3 estimate of KL(π_old || π): (r - 1) - log r with r = π/π_old.
        "approx_kl": (log_ratio.exp() - 1 - log_ratio).mean().item(),
        "ratio_behavior_mean": (logprobs - behavior)[m].exp().mean().item(),
        "ratio_proximal_mean": (logprobs - proximal)[m].exp().mean().item(),
    }


def mismatch_weights(config: MismatchCorrection, proximal: torch.Tensor, behavior: torch.Tensor) -> torch.Tensor | None:
    """Per-token loss weights correcting for the engine's log-prob μ differing from the trainer's
    π_prox: min(π_prox/μ, C) (``truncate``), 1 inside [α, β] and 0 outside (``mask``), or None."""
    if config.type == "none":
        return None
    ratio = torch.exp(proximal - behavior).detach()
    if config.type == "truncate":
        return ratio.clamp(max=config.cap)
    if config.type == "mask":
        return ((ratio >= config.low) & (ratio <= config.high)).to(ratio.dtype)
    raise ValueError(f"mismatch.type: unknown {config.type!r}")


def mismatch_stats(
    proximal: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor, stale: torch.Tensor
) -> dict[str, float]:
    """|log μ − log π_prox| over the generated tokens: mean and max over those sampled by the
    trainer's current weights (``fresh``: the two should agree; what is left is the engine's and
    the trainer's numerics) and over the ``stale`` ones (numerics plus the versions between).

    ``kl_behavior_{fresh,stale}``: KL(μ ‖ π_prox) estimated from μ's own samples (k3, unbiased,
    never negative): over stale tokens, how far the policy moved since they were sampled, the
    distance every off-policy correction has to bridge."""
    gap = (behavior - proximal).abs()
    log_r = proximal - behavior
    k3 = log_r.exp() - 1 - log_r
    out = {}
    for name, m in (("fresh", mask.bool() & ~stale.bool()), ("stale", mask.bool() & stale.bool())):
        if m.any():
            out |= {
                f"mismatch_{name}_mean": gap[m].mean().item(),
                f"mismatch_{name}_max": gap[m].max().item(),
                f"mismatch_{name}_tokens": float(m.sum()),
                f"kl_behavior_{name}": k3[m].mean().item(),
            }
    return out


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: Literal["k1", "k2", "k3"]) -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from samples of π (Schulman's k1, k2, k3)."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"kind: unknown KL estimator {kind!r} (k1, k2, k3)")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position: [..., V] → [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float | None = 0.2
) -> torch.Tensor:
    """PPO's critic loss: 0.5·max((V - R)², (clip(V, V_old ± ε) - R)²), token-mean."""
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * masked_mean(loss, mask)
