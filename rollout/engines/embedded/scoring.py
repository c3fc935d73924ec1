"""Scoring given tokens: the log-probs a model gives a sequence's own tokens (a prefill, no sampling).

What a teacher does in on-policy distillation (``trainer/distillation.py``): the student sampled the
tokens, the teacher says how likely each was under it. SGLang answers the same question through
``/generate`` with ``logprob_start_len`` and ``max_new_tokens: 0`` (its ``input_token_logprobs``).
"""

from __future__ import annotations

import torch


def token_logprobs(
    model, input_ids: list[int], start: int, device, keep_last: bool, top_k: int = 0
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """log p(x_t | x_<t) at temperature 1 for every position t in [start, N), one forward of the
    whole sequence; position 0 has no context, so its entry is None (SGLang's convention). With
    ``top_k``, also each position's ``top_k`` most likely tokens as (id, log-prob), most likely first
    (SGLang's ``input_top_logprobs``; the second list is empty without it).

    Only the logits that predict a scored token are kept (``logits_to_keep`` where the model takes it):
    a whole sequence's [N, vocab] would be most of the memory."""
    n = len(input_ids)
    first = max(start, 1)  # the first position with a context
    ids = torch.tensor([input_ids], device=device)
    keep = {"logits_to_keep": n - first + 1} if keep_last else {}
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False, **keep).logits[0]
    logits = logits[-(n - first + 1) : -1]  # position p's logits predict token p + 1
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, ids[0, first:, None].to(logp.device))[:, 0]
    lead = [None] * (first - start)
    if not top_k:
        return lead + chosen.tolist(), []
    values, indices = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
    tops = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
    return lead + chosen.tolist(), lead + tops
