"""Held-out evaluation: greedy answers to prompts never trained on, scored by the task's reward."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass
class HeldOut:
    accuracy: float
    unanswered: int  # prompts whose answer failed or timed out: scored as wrong
    first_error: str = ""

    def __str__(self) -> str:
        if not self.unanswered:
            return f"{self.accuracy:.3f}"
        return f"{self.accuracy:.3f} ({self.unanswered} unanswered, scored wrong: {self.first_error})"


async def heldout_accuracy(proxy_address: str, cfg) -> HeldOut:
    """Share of ``cfg.run.heldout_path``'s prompts answered fully correctly (reward >= 1), greedily,
    through the LLMProxy at ``proxy_address``, rendered as the episodes render them. An answer
    that fails or takes longer than ``cfg.run.heldout_timeout_s`` counts as wrong, and is counted."""
    from transformers import AutoTokenizer

    from rollout.chat_turns import render_prompt
    from rollout.envs import load_jsonl
    from rollout.rewards import resolve_reward
    from services.llm_proxy.client import ProxyClient
    from services.pb.rollmesh.v1 import common_pb2

    rows = load_jsonl(cfg.run.heldout_path)
    tok = AutoTokenizer.from_pretrained(cfg.env_manager.tokenizer_path)
    reward = resolve_reward(cfg.env_manager.reward)
    max_new = cfg.env_manager.episode.sampling.max_new_tokens
    client = ProxyClient(proxy_address, auth=cfg.auth)
    timeout_s = cfg.run.heldout_timeout_s

    async def answer(prompt: list[int]):
        t0 = time.monotonic()
        out = await client.generate(prompt, max_new, temperature=0.0, timeout_s=timeout_s)
        # An engine that ends its answer while the proxy aborts it at the deadline sends it whole, but late.
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"cut at {timeout_s:g} s")
        return out

    try:
        prompts = [render_prompt(tok, r["prompt"]) for r in rows]
        outs = await asyncio.gather(*(answer(p) for p in prompts), return_exceptions=True)
    finally:
        await client.close()
    errors, scores = [], []
    for out, row in zip(outs, rows):
        if not isinstance(out, BaseException) and out.finish_reason == common_pb2.FINISH_REASON_TIMEOUT:
            out = TimeoutError(f"cut at {cfg.run.heldout_timeout_s:g} s")  # a cut answer is not the model's answer
        if isinstance(out, BaseException):
            errors.append(out)
            scores.append(0.0)
        else:
            scores.append(reward(tok.decode(out.output_ids, skip_special_tokens=True), row["answer"]))
    first = f"{type(errors[0]).__name__}: {errors[0]}" if errors else ""
    return HeldOut(sum(s >= 1.0 for s in scores) / len(scores), len(errors), first)
