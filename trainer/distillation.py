"""On-policy distillation (OPD): a teacher's log-probs of the student's own tokens as the signal.

The student samples; a teacher scores each sampled token (its prefill, in the reward stage:
``Trajectory.teacher_logprobs``). Per token, g_t = log π(y_t) − log π_T(y_t) is a one-sample
estimate of the reverse KL, KL(π ‖ π_T) at that position, and its gradient through the
policy-gradient estimator moves π toward the teacher on the states the student itself visits. It
is added to the verifiable-reward advantage (slime's ``--use-opd``, ROLL's mixed pipelines):

    Â_t = w·A_t − λ·(g_t − b)

π is the student's log-prob as ``DistillConfig.student`` says (μ, the engine's, by default: what
sampled the token). b is a baseline: the mean gap over the group's tokens (``baseline: group``),
or 0 (``none``, slime's and the Thinking Machines recipe's form). Without one, every sampled token
the teacher dislikes is pushed down by several nats at once. On a one-token answer that spreads
probability over the whole vocabulary rather than toward the teacher's answer (the digit task,
docs/distillation.md). Â then enters whichever policy loss is configured, so decoupled PPO, TIS and
the mismatch corrections treat it as any advantage.

Where the teacher also sent its k most likely tokens at each position (``env_manager.teacher_top_k``),
the loss gains a term of its own, the forward KL from the teacher's top-k (renormalised) to the
student at every taught position, ``top_k_forward_kl``: a gradient toward the teacher's whole
distribution there, not only a judgement of the one token sampled. Pure functions over [B, T] tensors.
"""

from __future__ import annotations

import torch

from trainer.advantages import group_sums

_REFUSED = -1e30  # at or below: a log-prob of a token masked out (mask_logits' lowest value)


def reverse_kl_advantage(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, coef: float, group_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """−λ·(g_t − b) on the masked tokens, 0 elsewhere, g_t = log π − log π_T (no gradient: it is an
    advantage). ``group_ids`` given: b is the mean of g over the masked tokens of the row's group (a
    baseline, as GRPO's group mean is: it includes the row's own tokens, so nearly but not exactly
    unbiased, and it lowers the estimate's variance); None: b = 0."""
    gap = (student - teacher) * mask
    if group_ids is not None:
        tokens = group_sums(mask.sum(-1).to(gap.dtype), group_ids)
        gap = (gap - (group_sums(gap.sum(-1), group_ids) / tokens.clamp(min=1))[:, None]) * mask
    return (-coef * gap).detach()


def distilled_advantages(
    advantages: torch.Tensor,
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
    taught: torch.Tensor,
    *,
    coef: float,
    reward_coef: float,
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Â = w·A − λ·(g − b) on rows a teacher scored (``taught`` [B] bool), b the group's mean gap
    where ``group_ids`` is given (``reverse_kl_advantage``); the reward's A alone elsewhere (a domain
    without a teacher in a multi-domain batch)."""
    rows = taught.to(mask.dtype)[:, None] * mask
    mixed = reward_coef * advantages + reverse_kl_advantage(student, teacher, rows, coef, group_ids)
    return torch.where(rows > 0, mixed, advantages)


def distillation_sums(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, taught: torch.Tensor) -> list:
    """[Σ (log π − log π_T), taught tokens] over the taught tokens: summed over ranks, the first over
    the second is ``teacher_kl``, the reverse KL KL(π ‖ π_T) per token estimated (k1) from the
    student's own samples (it falls as the student learns the teacher)."""
    rows = taught.to(mask.dtype)[:, None] * mask
    return [float(((student - teacher) * rows).sum()), float(rows.sum())]


def top_k_forward_kl(student_top: torch.Tensor, teacher_top: torch.Tensor) -> torch.Tensor:
    """Per position, KL(p̃_T ‖ π) = Σ_k p̃_T(k)·(log p̃_T(k) − log π(k)) over the teacher's top-k tokens:
    ``teacher_top`` their teacher log-probs ([..., k]; −inf pads a row of fewer), p̃_T those renormalised
    to sum 1; ``student_top`` π's log-probs of the same tokens. It is >= 0, as π's mass on the k tokens
    is at most 1, and 0 only where π puts all its mass on them in the teacher's proportions. A token π
    cannot produce (log-prob −inf or the dtype's lowest: a grammar refused it) is no candidate, the
    others renormalised; a position with none left contributes 0."""
    allowed = student_top > _REFUSED
    p = torch.nan_to_num(torch.softmax(teacher_top.masked_fill(~allowed, float("-inf")), dim=-1), nan=0.0)
    return (torch.xlogy(p, p) - p * student_top.masked_fill(~allowed, 0.0)).sum(-1)
