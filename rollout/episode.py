"""One episode: render the observation once, generate, step the environment, repeat.

Token-in, token-out: the prompt is rendered once with the chat template; generated tokens go
into the trajectory exactly as the engine produced them and are never re-tokenized; a later
user turn is rendered on its own and appended (loss mask 0). Every generation and every
environment step has a deadline; missing one ends the trajectory with ``timeout``.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from rollout.envs.base import Env
from rollout.turn_barrier import TurnBarrier
from sample_buffer.trajectory import Trajectory


@dataclass
class Generation:
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: str  # stop | length | abort | timeout


# generate(input_ids, sampling_params, trajectory_id, timeout_s) -> Generation
GenerateFn = Callable[[list[int], dict, str, float], Awaitable[Generation]]


class EpisodeConfig(BaseModel):
    """Per-episode limits."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(1, ge=1, description="Generations per episode at most.")
    max_new_tokens: int = Field(8, ge=1, description="Tokens per generation at most.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    generation_timeout_s: float = Field(60.0, gt=0, description="Deadline of one generation (suspension included).")
    step_timeout_s: float = Field(30.0, gt=0, description="Deadline of one environment step (reward included).")


def render_user_turn(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def run_episode(
    env: Env,
    seed: int,
    generate: GenerateFn,
    tokenizer,
    config: EpisodeConfig,
    *,
    trajectory_id: str,
    group_id: str,
    prompt_id: str,
    barrier: TurnBarrier | None = None,
) -> Trajectory:
    """Run one episode. With a ``barrier`` (batch rollout) every turn's generation waits for all
    episodes' generations, and every environment step for all episodes' steps."""
    try:
        return await _run_episode(env, seed, generate, tokenizer, config, trajectory_id, group_id, prompt_id, barrier)
    finally:
        if barrier is not None:
            barrier.leave()


async def _env_step(env: Env, action: str):
    if inspect.iscoroutinefunction(env.step):
        return await env.step(action)
    return await asyncio.to_thread(env.step, action)


async def _run_episode(env, seed, generate, tokenizer, config, trajectory_id, group_id, prompt_id, barrier):
    t0 = time.monotonic()
    obs = env.reset(seed)
    tokens = render_user_turn(tokenizer, obs)
    mask = [0] * len(tokens)
    logprobs: list[float] = []
    versions: list[int] = []
    reward, finish, turns = 0.0, "stop", []
    generate_s: list[float] = []  # seconds of each turn's generation and environment step (for metrics)
    step_s: list[float] = []
    sampling = {"max_new_tokens": config.max_new_tokens, "temperature": config.temperature, "top_p": config.top_p}
    for _ in range(config.max_turns):
        t_gen = time.monotonic()
        gen = await generate(tokens, sampling, trajectory_id, config.generation_timeout_s)
        generate_s.append(round(time.monotonic() - t_gen, 6))
        turns.append(len(tokens))
        tokens += gen.output_ids
        mask += [1] * len(gen.output_ids)
        logprobs += gen.logprobs
        versions += gen.versions
        if gen.finish in ("timeout", "abort"):
            finish = gen.finish
            break
        if barrier is not None:
            await barrier.wait()  # generate all, then step all
        action = tokenizer.decode(gen.output_ids, skip_special_tokens=True)
        t_step = time.monotonic()
        try:
            result = await asyncio.wait_for(_env_step(env, action), config.step_timeout_s)
        except TimeoutError:
            finish = "timeout"
            break
        finally:
            step_s.append(round(time.monotonic() - t_step, 6))
        if barrier is not None and not (result.done or result.observation is None):
            await barrier.wait()  # step all, then generate the next turn together
        reward += result.reward
        finish = gen.finish
        if result.done or result.observation is None:
            break
        next_turn = render_user_turn(tokenizer, result.observation)
        tokens += next_turn
        mask += [0] * len(next_turn)
    return Trajectory(
        trajectory_id=trajectory_id,
        group_id=group_id,
        prompt_id=prompt_id,
        token_ids=tokens,
        loss_mask=mask,
        behavior_logprobs=logprobs,
        token_versions=versions,
        reward=reward,
        start_version=versions[0] if versions else 0,
        finish_reason=finish,
        metadata={
            "env": env.name,
            "turn_starts": turns,
            "seconds": round(time.monotonic() - t0, 4),
            "generate_s": generate_s,
            "step_s": step_s,
        },
    )
