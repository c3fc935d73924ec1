"""Held-out evaluation: greedy answers to prompts never trained on, scored by the task's reward."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass

from sample_buffer.deadlines import wait_for


@dataclass
class HeldOut:
    accuracy: float
    unanswered: int  # prompts whose answer failed or timed out: scored as wrong
    first_error: str = ""
    scoring_faults: int = 0  # answers the reward could not score (a verifier's fault, the service away): wrong
    prompts: int = 0

    def __str__(self) -> str:
        notes = [f"{self.unanswered} unanswered, scored wrong: {self.first_error}"] if self.unanswered else []
        notes += [f"{self.scoring_faults} not scored (reward faults), counted wrong"] if self.scoring_faults else []
        return f"{self.accuracy:.3f}" + (f" ({'; '.join(notes)})" if notes else "")


@dataclass
class DomainsHeldOut:
    """Each domain's held-out set, scored with its own reward; ``accuracy`` over all their prompts."""

    by_domain: dict[str, HeldOut]

    @property
    def accuracy(self) -> float:
        prompts = sum(h.prompts for h in self.by_domain.values())
        return sum(h.accuracy * h.prompts for h in self.by_domain.values()) / max(1, prompts)

    @property
    def unanswered(self) -> int:
        return sum(h.unanswered for h in self.by_domain.values())

    @property
    def scoring_faults(self) -> int:
        return sum(h.scoring_faults for h in self.by_domain.values())

    def __str__(self) -> str:
        width = max(6, *(len(d) for d in self.by_domain))
        lines = [f"{self.accuracy:.3f} over all domains", f"  {'domain':<{width}}  prompts  accuracy"]
        for d, h in self.by_domain.items():
            lines.append(f"  {d:<{width}}  {h.prompts:>7}  {h}")
        return "\n".join(lines)


async def heldout_accuracy(proxy_address: str, cfg) -> HeldOut:
    """Share of ``cfg.run.heldout_path``'s prompts answered fully correctly (reward >= 1), greedily,
    through the LLMProxy at ``proxy_address``, rendered as the episodes render them. An answer
    that fails or takes longer than ``cfg.run.heldout_timeout_s`` counts as wrong, and is counted."""
    em = cfg.env_manager
    return await _score_prompts(proxy_address, cfg, cfg.run.heldout_path, em.reward, em.episode)


async def heldout_by_domain(proxy_address: str, cfg) -> DomainsHeldOut:
    """Each domain's ``heldout_path``, as ``heldout_accuracy`` scores one, with the domain's reward
    and sampling length; the domains one after another (each already asks for all its answers at once)."""
    em = cfg.env_manager
    return DomainsHeldOut(
        {
            d.name: await _score_prompts(proxy_address, cfg, d.heldout_path, d.reward, em.episode_of(d))
            for d in em.domains
            if d.heldout_path
        }
    )


async def _score_prompts(proxy_address: str, cfg, path: str, reward_spec, episode) -> HeldOut:
    from transformers import AutoTokenizer

    from rollout.chat_turns import render_prompt
    from rollout.envs import load_jsonl
    from rollout.envs.single_turn import images_of_rows
    from rollout.rewards import build_reward
    from services.llm_proxy.client import ProxyClient
    from services.pb.rollmesh.v1 import common_pb2
    from services.reward.ports import reward_ports

    rows = load_jsonl(path)
    tok = AutoTokenizer.from_pretrained(cfg.env_manager.tokenizer_path)
    reward = build_reward(reward_spec, **reward_ports(cfg.auth, reward_address=cfg.mesh.reward))
    max_new = episode.sampling.max_new_tokens
    client = ProxyClient(proxy_address, auth=cfg.auth)
    timeout_s = cfg.run.heldout_timeout_s

    async def answer(prompt: list[int], images: tuple[bytes, ...]):
        t0 = time.monotonic()
        out = await client.generate(prompt, max_new, temperature=0.0, timeout_s=timeout_s, images=images)
        # An engine that ends its answer while the proxy aborts it at the deadline sends it whole, but late.
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"cut at {timeout_s:g} s")
        return out

    try:
        shown = images_of_rows(rows)  # a vision-language task's pictures, one placeholder each before the text
        placeholder = _placeholder(cfg.env_manager.tokenizer_path) if shown else ""
        prompts = [render_prompt(tok, placeholder * len(shown.get(i, ())) + r["prompt"]) for i, r in enumerate(rows)]
        outs = await asyncio.gather(
            *(answer(p, shown.get(i, ())) for i, p in enumerate(prompts)), return_exceptions=True
        )
    finally:
        await client.close()
    # A variant may block (a sandbox run, a call to the reward service): scored in threads, all at once.
    # A function is called here, in the main thread, where math-verify's time limits work.
    inline = isinstance(reward_spec, str)
    errors, scored = [], []
    for out, row in zip(outs, rows):
        if not isinstance(out, BaseException) and out.finish_reason == common_pb2.FINISH_REASON_TIMEOUT:
            out = TimeoutError(f"cut at {cfg.run.heldout_timeout_s:g} s")  # a cut answer is not the model's answer
        if isinstance(out, BaseException):
            errors.append(out)
        else:
            response = tok.decode(out.output_ids, skip_special_tokens=True)
            score = reward if inline else functools.partial(asyncio.to_thread, reward)
            scored.append(score(response, row["answer"]))
    faults = sum(getattr(reward, "failures", {}).values())
    try:
        scores = scored if inline else await asyncio.gather(*scored)
    finally:
        getattr(reward, "close", lambda: None)()  # the reward service's channel
    faults = sum(getattr(reward, "failures", {}).values()) - faults
    first = f"{type(errors[0]).__name__}: {errors[0]}" if errors else ""
    return HeldOut(sum(s >= 1.0 for s in scores) / len(rows), len(errors), first, faults, len(rows))


def _placeholder(model_path: str) -> str:
    from sample_buffer.vision import vision_of

    if (vision := vision_of(model_path)) is None:
        raise ValueError(f"run.heldout_path: its prompts show images; {model_path} has no vision tower")
    return vision.placeholder


async def heldout_episodes(proxy_address: str, cfg) -> HeldOut:
    """A remote environment's held-out success: ``cfg.run.heldout_episodes`` greedy episodes on the
    seeds after the ones training draws from (``env.num_seeds`` on), played through the LLMProxy
    and the providers as training plays them; an episode succeeds with reward >= 1. One that
    ends in an error or a missed deadline counts as failed, and is counted."""
    from transformers import AutoTokenizer

    from rollout.envs.remote import RemoteEnv
    from rollout.episode import run_episode
    from sample_buffer.trajectory import FinishReason
    from services.env_provider.clients import build_pool
    from services.llm_proxy.client import ProxyClient, ProxyGenerate

    env_config, episode = cfg.env_manager.env, cfg.env_manager.episode
    greedy = episode.model_copy(update={"sampling": episode.sampling.model_copy(update={"temperature": 0.0})})
    tok = AutoTokenizer.from_pretrained(cfg.env_manager.tokenizer_path)
    client, pool = ProxyClient(proxy_address, auth=cfg.auth), build_pool(env_config, cfg.auth)
    engine = ProxyGenerate(client)

    async def generate(ids, sampling, tid, timeout_s):
        return await engine.generate(ids, sampling, request_id=tid, route=tid, timeout_s=timeout_s)

    async def play(seed: int):
        tid = f"heldout-{seed}-{time.monotonic_ns()}"
        return await wait_for(
            run_episode(
                RemoteEnv(pool, tid),
                seed,
                generate,
                tok,
                greedy,
                trajectory_id=tid,
                group_id="heldout",
                prompt_id=f"s{seed}",
            ),
            cfg.run.heldout_timeout_s,
        )

    seeds = range(env_config.num_seeds, env_config.num_seeds + cfg.run.heldout_episodes)
    try:
        outs = await asyncio.gather(*(play(s) for s in seeds), return_exceptions=True)
    finally:
        await asyncio.gather(client.close(), pool.aclose())
    failed: list[BaseException] = []
    for o in outs:
        if isinstance(o, BaseException):
            failed.append(o)
        elif o.finish_reason in (FinishReason.ENV_ERROR, FinishReason.TIMEOUT):
            failed.append(RuntimeError(f"{o.finish_reason}: {o.metadata.get('error') or o.metadata.get('timeout')}"))
    wins = sum(not isinstance(o, BaseException) and o.reward >= 1.0 for o in outs)
    first = f"{type(failed[0]).__name__}: {failed[0]}" if failed else ""
    return HeldOut(wins / len(outs), len(failed), first, prompts=len(outs))


def evaluator(cfg):
    """How this run's held-out set is evaluated, or None: a JSONL of prompts, a remote environment's
    unseen seeds, or each domain's own set."""
    if cfg.run.heldout_path:
        return heldout_accuracy
    if cfg.run.heldout_episodes:
        return heldout_episodes
    return heldout_by_domain if any(d.heldout_path for d in cfg.env_manager.domains) else None
