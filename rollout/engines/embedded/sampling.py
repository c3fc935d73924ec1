"""The pure math of sampling: turning logits into tokens and log-probs.

Log-probs follow SGLang: ``log_softmax(logits / temperature)`` over the full vocabulary, taken
*before* top-p / top-k truncation, so they are the behaviour policy's probabilities of the
sampled tokens at that temperature. Greedy decoding (temperature 0) reports
``log_softmax(logits)``, as if temperature were 1. As in SGLang, a temperature below
``GREEDY_BELOW`` is greedy: dividing by it overflows the logits (NaN probabilities).
"""

from __future__ import annotations

import torch

from rollout.sampling import SamplingParams

GREEDY_BELOW = 1e-6  # SGLang's _SAMPLING_EPS


def token_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Log-probs of the whole vocabulary at each row's temperature.

    logits: [B, V] float; temperatures: [B] (below ``GREEDY_BELOW`` = greedy, treated as 1). Returns [B, V].
    """
    temps = torch.where(temperatures >= GREEDY_BELOW, temperatures, torch.ones_like(temperatures))
    return torch.log_softmax(logits.float() / temps[:, None], dim=-1)


def truncate_top_k_top_p(logprobs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token outside each row's top-k and top-p nucleus.

    logprobs: [B, V]; top_k: [B] int (<= 0 = no limit); top_p: [B] float in (0, 1].
    The most likely token always survives.
    """
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
    ranks = torch.arange(logprobs.shape[-1], device=logprobs.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, logprobs.shape[-1]))
    drop = ranks >= k[:, None]
    # Mass strictly before each token: a token is kept while the nucleus is still below top_p.
    mass_before = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp()
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
    return torch.full_like(logprobs, float("-inf")).scatter(-1, order, sorted_lp)


def sample_next_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and return ``(token_ids [B], logprobs [B])``.

    Rows with a ``sampling_seed`` draw from their own generator so their output does not
    depend on which other requests share the batch.
    """
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device)
    logprobs = token_logprobs(logits, temps)
    tokens = logprobs.argmax(dim=-1)
    sampled = (temps >= GREEDY_BELOW).nonzero().flatten().tolist()
    if sampled:
        top_k = torch.tensor([params[i].top_k for i in sampled], device=device)
        top_p = torch.tensor([params[i].top_p for i in sampled], device=device)
        rows = logprobs[sampled]
        if bool((top_k > 0).any() or (top_p < 1).any()):
            rows = truncate_top_k_top_p(rows, top_k, top_p)
        probs = rows.exp()
        shared = [j for j, i in enumerate(sampled) if generators[i] is None]
        if shared:
            draws = torch.multinomial(probs[shared], 1, generator=default_generator).flatten()
            tokens[[sampled[j] for j in shared]] = draws
        for j, i in enumerate(sampled):
            if generators[i] is not None:
                tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen


def top_logprobs(logits: torch.Tensor, params: list[SamplingParams], ks: list[int]) -> list[list[tuple[int, float]]]:
    """Each row's ``ks[i]`` most likely tokens as ``(token_id, logprob)``, most likely first, in the
    log-probs the sampled token's are reported in (``token_logprobs``, before top-p / top-k).

    logits: [B, V]; rows with k 0 get []. Only the rows that ask are normalised."""
    rows = [i for i, k in enumerate(ks) if k > 0]
    out: list[list[tuple[int, float]]] = [[] for _ in ks]
    if not rows:
        return out
    temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)
    values, ids = token_logprobs(logits[rows], temps).topk(min(max(ks), logits.shape[-1]), dim=-1)
    for j, i in enumerate(rows):  # (a grammar's mask leaves some tokens -inf: not among the likely ones)
        out[i] = [(t, v) for t, v in zip(ids[j, : ks[i]].tolist(), values[j, : ks[i]].tolist()) if v > float("-inf")]
    return out
