"""A diagnostic for asynchronous training: how far the policy moves per step, and whether μ is
the policy each token says sampled it.

``trainer.audit_versions: N`` keeps CPU copies of the last N versions' weights. At the start of
every step, before any update, on the batch's generated positions (the contexts the engines'
samples reached):

- ``policy_kl_k`` (k = 1..N): KL(π_v ‖ π_{v−k}) over the whole vocabulary at each position,
  averaged: how far the policy moved in the last k steps, exact per context, no estimator noise.
  This is what staleness k costs: a token sampled k versions ago came from π_{v−k}.
- ``audit_mu_err_mean`` / ``_max`` (``_stale_`` for tokens sampled by older weights):
  |log π_u(token) − μ| where u is the version the token is tagged with, teacher-forced with u's
  own weights: the engine's numerics alone if tagging and weight sync are right, anything larger
  is a token tagged with the wrong version or an engine serving other weights than it says.
  ``audit_missing_tokens``: tokens whose version is older than the copies kept.

Costs N copies of the weights and up to N + 1 extra forward passes per step: a diagnostic for
small models and benches (``rollmesh bench offpolicy --audit``), off by default, single-process trainers only.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch

from trainer.packing import padded_inputs, scale_by_temperature

AUDIT_ROW_TOKENS = 1024  # padded tokens per audit forward: bounds the [rows, T, V] log-softmax held at once


def position_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per position from full-vocabulary log-probs [..., V] → [...]."""
    return (logp.exp() * (logp - logq)).sum(-1)


def _next_token_logprobs(model, seqs: list, temps, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, V] log-probs of each position's token given the tokens before it (position 0: zeros),
    at its sampling temperature, aligned to the tokens like ``gather_token_logprobs``; and the
    padded ids [B, T]."""
    ids, attn = padded_inputs(seqs, device)
    logits = model(input_ids=ids, attention_mask=attn).logits
    temps = None if temps is None else temps[:, : ids.shape[1]]
    logp = torch.log_softmax(scale_by_temperature(logits, temps)[:, :-1], dim=-1)
    return torch.nn.functional.pad(logp, (0, 0, 1, 0)), ids


class PolicyAudit:
    def __init__(self, model: torch.nn.Module, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"audit_versions: must be >= 1, got {keep}")
        self.keep = keep
        self.history: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()  # version -> weights, oldest first
        self._spare = copy.deepcopy(model).eval()  # the model an old version's weights are loaded into
        self._spare.requires_grad_(False)

    @staticmethod
    def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def remember(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Keep ``weights`` as ``version``'s, dropping the oldest past ``keep``."""
        self.history[version] = weights
        while len(self.history) > self.keep:
            self.history.popitem(last=False)

    @torch.no_grad()
    def measure(self, model, batch, version: int, mask: torch.Tensor, behavior: torch.Tensor, device) -> dict:
        """The metrics above for ``batch`` at ``version`` (``model`` holds its weights)."""
        was_training = model.training
        model.eval()
        seqs = batch.sequences
        width = mask.shape[1]
        tags = batch.token_versions
        kl_sum = {k: 0.0 for k in range(1, self.keep + 1) if version - k in self.history}
        err: list[torch.Tensor] = []
        err_stale: list[torch.Tensor] = []
        missing = 0.0
        n_pos = 0.0
        rows_per_pass = max(1, AUDIT_ROW_TOKENS // max(width, 1))
        try:
            for start in range(0, len(seqs), rows_per_pass):
                rows = list(range(start, min(start + rows_per_pass, len(seqs))))
                temps = None if batch.temperatures is None else batch.temperatures[rows]
                cur, ids = _next_token_logprobs(model, [seqs[r] for r in rows], temps, device)
                t = cur.shape[1]
                m = mask[rows, :t].bool()
                mu = behavior[rows, :t]
                tag = tags[rows, :t].to(device) if tags is not None else torch.full_like(ids, version)
                n_pos += float(m.sum())
                picked = {version: cur.gather(-1, ids[..., None]).squeeze(-1)}
                for u, weights in self.history.items():
                    wanted_kl = version - u in kl_sum
                    if not wanted_kl and not bool((m & (tag == u)).any()):
                        continue
                    self._spare.load_state_dict(weights)
                    old, _ = _next_token_logprobs(self._spare, [seqs[r] for r in rows], temps, device)
                    if wanted_kl:
                        kl_sum[version - u] += float(position_kl(cur, old)[m].sum())
                    picked[u] = old.gather(-1, ids[..., None]).squeeze(-1)
                for u, lp in picked.items():
                    here = m & (tag == u)
                    if here.any():
                        gap = (lp - mu)[here].abs()
                        (err if u == version else err_stale).append(gap)
                missing += float((m & ~torch.isin(tag, torch.tensor(list(picked), device=tag.device))).sum())
        finally:
            model.train(was_training)
        out = {f"policy_kl_{k}": s / max(n_pos, 1.0) for k, s in kl_sum.items()}
        every = torch.cat(err + err_stale) if err or err_stale else None
        if every is not None:
            out |= {"audit_mu_err_mean": float(every.mean()), "audit_mu_err_max": float(every.max())}
        if err_stale:
            stale = torch.cat(err_stale)
            out |= {
                "audit_mu_err_stale_mean": float(stale.mean()),
                "audit_mu_err_stale_max": float(stale.max()),
                "audit_stale_tokens": float(stale.numel()),
            }
        out["audit_missing_tokens"] = missing
        return out
