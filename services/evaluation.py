"""Held-out evaluation: greedy answers to prompts never trained on, scored by the task's reward."""

from __future__ import annotations

import asyncio


async def heldout_accuracy(proxy_address: str, cfg) -> float:
    """Share of ``cfg.run.heldout_path``'s prompts answered fully correctly (reward >= 1), greedily,
    through the LLMProxy at ``proxy_address``, rendered as the episodes render them."""
    from transformers import AutoTokenizer

    from rollout.envs import load_jsonl
    from rollout.episode import render_user_turn
    from rollout.rewards import resolve_reward
    from services.llm_proxy.client import ProxyClient

    rows = load_jsonl(cfg.run.heldout_path)
    tok = AutoTokenizer.from_pretrained(cfg.env_manager.tokenizer_path)
    reward = resolve_reward(cfg.env_manager.reward)
    max_new = cfg.env_manager.episode.sampling.max_new_tokens
    client = ProxyClient(proxy_address, auth=cfg.auth)
    try:
        prompts = [render_user_turn(tok, r["prompt"]) for r in rows]
        outs = await asyncio.gather(*(client.generate(p, max_new, temperature=0.0, timeout_s=60) for p in prompts))
    finally:
        await client.close()
    scores = [reward(tok.decode(o.output_ids, skip_special_tokens=True), r["answer"]) for o, r in zip(outs, rows)]
    return sum(s >= 1.0 for s in scores) / len(scores)
