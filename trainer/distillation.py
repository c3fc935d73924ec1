"""On-policy distillation (OPD): a teacher's log-probs of the student's own tokens as the signal.

The student samples; a teacher scores each sampled token (its prefill, in the reward stage:
``Trajectory.teacher_logprobs``). Per token, log π_T(y_t) − log π(y_t) is a one-sample estimate of
minus the reverse KL, KL(π ‖ π_T) at that position, and its gradient through the policy-gradient
estimator moves π toward the teacher on the states the student itself visits. It is added to the
verifiable-reward advantage (slime's ``--use-opd``, ROLL's mixed pipelines):

    Â_t = w·A_t − λ·(log π(y_t) − log π_T(y_t))

with π the student's log-prob as ``DistillConfig.student`` says (μ, the engine's, by default: what
sampled the token). Â then enters whichever policy loss is configured, so decoupled PPO, TIS and
the mismatch corrections treat it as any advantage. Pure functions over [B, T] tensors.
"""

from __future__ import annotations

import torch


def reverse_kl_advantage(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """−λ·(log π − log π_T) on the masked tokens, 0 elsewhere (no gradient: it is an advantage)."""
    return (-coef * (student - teacher) * mask).detach()


def distilled_advantages(
    advantages: torch.Tensor,
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
    taught: torch.Tensor,
    *,
    coef: float,
    reward_coef: float,
) -> torch.Tensor:
    """Â = w·A − λ·(log π − log π_T) on rows a teacher scored (``taught`` [B] bool); the reward's A
    alone elsewhere (a domain without a teacher in a multi-domain batch)."""
    rows = taught.to(mask.dtype)[:, None] * mask
    mixed = reward_coef * advantages + reverse_kl_advantage(student, teacher, rows, coef)
    return torch.where(rows > 0, mixed, advantages)


def distillation_sums(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, taught: torch.Tensor) -> list:
    """[Σ (log π − log π_T), taught tokens] over the taught tokens: summed over ranks, the first over
    the second is ``teacher_kl``, the reverse KL KL(π ‖ π_T) per token estimated (k1) from the
    student's own samples (it falls as the student learns the teacher)."""
    rows = taught.to(mask.dtype)[:, None] * mask
    return [float(((student - teacher) * rows).sum()), float(rows.sum())]
