"""Sequence packing: several trajectories in one row, attention kept within each.

A packed row concatenates sequences; position ids restart at 0 for each, and a block-diagonal
causal mask stops a token from seeing the sequence before it. The numbers equal running each
sequence alone (tested to 1e-5 in float32) while the matmuls see no padding.
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


def pack_rows(seqs: list, row_tokens: int) -> list[list[int]]:
    """Indices of ``seqs`` per packed row of at most ``row_tokens`` tokens (first-fit decreasing)."""
    return plan_micro_batches([len(s) for s in seqs], row_tokens)


def packed_inputs(rows: list[list], device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``rows`` of sequences → input_ids [R, W], position_ids [R, W] and block-diagonal causal masks.

    Rows are right-padded to the longest; padding positions attend only to themselves, which keeps
    their unused activations finite. The mask is dense, so attention costs W² per row: rows are
    kept short (``pack_row_tokens``) where no variable-length attention kernel is available.
    """
    width = max(sum(len(s) for s in row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    doc = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for d, s in enumerate(row):
            ids[r, start : start + len(s)] = torch.as_tensor(s, dtype=torch.long)
            positions[r, start : start + len(s)] = torch.arange(len(s))
            doc[r, start : start + len(s)] = d
            start += len(s)
    same_doc = (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0)
    mask = torch.tril(torch.ones(width, width, dtype=torch.bool))[None] & same_doc
    mask |= torch.eye(width, dtype=torch.bool)[None]
    mask = mask[:, None].to(device)
    return ids.to(device), positions.to(device), {"full_attention": mask, "sliding_attention": mask}


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
    logp = torch.log_softmax(scale_by_temperature(logits, temps)[..., :-1, :], dim=-1)
    picked = logp.gather(-1, ids[..., 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))
