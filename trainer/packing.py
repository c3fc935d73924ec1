"""Micro-batch planning, the padded (unpacked) inputs, and log-probs from logits.

Packed rows are laid out in ``trainer/prefix_tree.py`` and attended in ``trainer/varlen.py``.
"""

from __future__ import annotations

import torch


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices into bins of at most ``max_tokens`` tokens (first-fit decreasing).
    A sequence longer than the budget gets a bin of its own."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]


def padded_inputs(seqs: list, device, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input_ids [B, T] and attention_mask [B, T] (the unpacked baseline)."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long, device=device)
        attn[i, : len(s)] = 1
    return ids, attn


def scale_by_temperature(logits: torch.Tensor, temps: torch.Tensor | None) -> torch.Tensor:
    """``logits`` [..., L, V] at the temperature of the token each position predicts: position t
    predicts token t + 1, so it is divided by ``temps[..., t + 1]`` ([..., L], aligned to the
    tokens; None: all 1). The last position predicts nothing and is left as it is."""
    if temps is None:
        return logits.float()
    t = torch.nn.functional.pad(temps[..., 1:], (0, 1), value=1.0).to(logits.device)
    return logits.float() / t[..., None]


def gather_token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temps: torch.Tensor | None = None) -> torch.Tensor:
    """log p(ids[t] | ids[<t]) aligned to ids: position 0 gets 0 (nothing predicts it); with
    ``temps`` (aligned to ids) each at its token's sampling temperature, as the engine reported μ.

    logits: [..., L, V]; ids: [..., L] → [..., L].
    """
    return scaled_token_logprobs(scale_by_temperature(logits, temps), ids)


def scaled_token_logprobs(scaled: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``gather_token_logprobs`` of logits already at their temperature (and under any grammar's mask)."""
    return scaled_logprobs(scaled, ids)[0]


def scaled_logprobs(
    scaled: torch.Tensor, ids: torch.Tensor, candidates: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``scaled_token_logprobs``, and with ``candidates`` ([..., L, k] token ids aligned to ``ids``)
    the log-probs of each position's candidates from the same softmax ([..., L, k]; position 0 gets
    0s): a teacher's top-k tokens, for the forward KL. One log-softmax of [..., L, V] serves both."""
    logp = torch.log_softmax(scaled[..., :-1, :], dim=-1)
    picked = torch.nn.functional.pad(logp.gather(-1, ids[..., 1:, None]).squeeze(-1), (1, 0))
    if candidates is None:
        return picked, None
    return picked, torch.nn.functional.pad(logp.gather(-1, candidates[..., 1:, :]), (0, 0, 1, 0))
