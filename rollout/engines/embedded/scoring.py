"""Scoring given tokens: the log-probs a model gives a sequence's own tokens (a prefill, no sampling).

What a teacher does in on-policy distillation (``trainer/distillation.py``): the student sampled the
tokens, the teacher says how likely each was under it. SGLang answers the same question through
``/generate`` with ``logprob_start_len`` and ``max_new_tokens: 0`` (its ``input_token_logprobs``).

The calls that wait together are scored together: a group's members arrive at once, and one
left-padded forward of them all (each distinct sequence once) costs about what one of them does on
a CPU, where a forward each cost the teacher most of a distillation step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# What one batched forward may hold: its padded tokens (the engine's max_prefill_tokens) and the
# logits it keeps, rows x scored positions x vocabulary (4 bytes each: 256 MB).
MAX_KEPT_LOGITS = 64 << 20


@dataclass(frozen=True)
class ScoreJob:
    """One sequence to score from ``start`` on, with its ``top_k`` most likely tokens at each position."""

    input_ids: tuple[int, ...]
    start: int
    top_k: int = 0

    @property
    def first(self) -> int:
        return max(self.start, 1)  # the first position with a context

    @property
    def scored(self) -> int:
        return len(self.input_ids) - self.first


Scored = tuple[list[float | None], list[list[tuple[int, float]] | None]]


def chunks(jobs: list[ScoreJob], max_tokens: int, vocab: int) -> list[list[ScoreJob]]:
    """``jobs`` in batches whose padded tokens fit ``max_tokens`` and kept logits ``MAX_KEPT_LOGITS``
    (a job alone always makes a batch)."""
    out: list[list[ScoreJob]] = []
    for job in jobs:
        cur = out[-1] if out else None
        if cur is not None:
            rows, width = len(cur) + 1, max(len(job.input_ids), *(len(j.input_ids) for j in cur))
            keep = max(job.scored, *(j.scored for j in cur)) + 1
            if rows * width <= max_tokens and rows * keep * vocab <= MAX_KEPT_LOGITS:
                cur.append(job)
                continue
        out.append([job])
    return out


def score_batch(model, jobs: list[ScoreJob], device, keep_last: bool) -> list[Scored]:
    """For each job, log p(x_t | x_<t) at temperature 1 for every position t in [start, N), and with
    its ``top_k`` each position's most likely tokens as (id, log-prob), best first (SGLang's
    ``input_top_logprobs``; [] without); position 0 has no context, so its entries are None (SGLang's
    convention). One forward of the jobs left-padded, so every sequence ends in the last column and
    only the logits that predict a scored token are kept (``logits_to_keep``, where the model takes it)."""
    width = max(len(j.input_ids) for j in jobs)
    keep = max(j.scored for j in jobs) + 1
    ids = torch.zeros(len(jobs), width, dtype=torch.long)
    valid = torch.zeros(len(jobs), width, dtype=torch.long)
    for i, j in enumerate(jobs):
        ids[i, width - len(j.input_ids) :] = torch.tensor(j.input_ids)
        valid[i, width - len(j.input_ids) :] = 1
    ids, valid = ids.to(device), valid.to(device)
    positions = (valid.cumsum(-1) - 1).clamp(min=0)
    extra = {"logits_to_keep": keep} if keep_last else {}
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=valid, position_ids=positions, use_cache=False, **extra).logits
    logp = torch.log_softmax(logits[:, -keep:-1].float(), dim=-1)  # column c predicts the token after it
    out: list[Scored] = []
    for i, j in enumerate(jobs):
        lead = [None] * (j.first - j.start)
        if not j.scored:
            out.append((lead, lead if j.top_k else []))
            continue
        row = logp[i, keep - 1 - j.scored :]  # the predictions of this sequence's scored tokens
        chosen = row.gather(-1, ids[i, width - j.scored :, None])[:, 0].tolist()
        if not j.top_k:
            out.append((lead + chosen, []))
            continue
        values, indices = row.topk(min(j.top_k, row.shape[-1]), dim=-1)
        tops = [list(zip(a, b, strict=True)) for a, b in zip(indices.tolist(), values.tolist(), strict=True)]
        out.append((lead + chosen, lead + tops))
    return out
