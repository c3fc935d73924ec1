"""One episode, by the config's workflow (``rollout/workflows``; by default an ``Env``'s: render the
observation once, generate, step the environment, repeat).

Token-in, token-out: the prompt is rendered once with the chat template; generated tokens go
into the trajectory exactly as the engine produced them and are never re-tokenized; a later
turn (the environment's ``user`` or ``tool`` message) is the text the template adds for it
(``rollout/chat_turns.py``), appended with loss mask 0. Every generation and every
environment call (reset and step) has a deadline; missing one ends the trajectory with
``timeout``, and an environment that raises ends it with ``env_error``. What becomes of such a
member is the rollout loop's call (``RolloutConfig.faulty_members``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from rollout.env_calls import close_env
from rollout.envs.base import Env
from rollout.ports import Generation, RolloutObserver
from rollout.sampling import SamplingParams
from rollout.turn_barrier import TurnBarrier
from rollout.workflows import EnvWorkflowConfig, WorkflowConfig, env_episode
from rollout.workflows.context import Ended, EpisodeContext, WorkflowError, report
from sample_buffer.trajectory import FinishReason, Trajectory

# generate(input_ids, sampling, trajectory_id, timeout_s[, images=...]) -> Generation (images: a vision prompt's)
GenerateFn = Callable[[list[int], SamplingParams, str, float], Awaitable[Generation]]
log = logging.getLogger(__name__)


class LatencyPenalty(BaseModel):
    """A documented reward shaping for latency: ``reward -= penalty`` per turn over ``target_s``."""

    model_config = ConfigDict(extra="forbid")

    target_s: float = Field(..., gt=0, description="A turn that takes longer (generation + step, seconds) pays.")
    penalty: float = Field(..., ge=0, description="Reward taken off per turn over the target.")


class EpisodeConfig(BaseModel):
    """Per-episode limits and sampling."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(1, ge=1, description="Generations per episode at most.")
    sampling: SamplingParams = Field(
        default_factory=SamplingParams, description="How every turn's generation samples (SamplingParams' defaults)."
    )
    generation_timeout_s: float = Field(60.0, gt=0, description="Deadline of one generation (suspension included).")
    step_timeout_s: float = Field(30.0, gt=0, description="Deadline of one environment step (reward included).")
    latency_penalty: LatencyPenalty | None = Field(
        None,
        description="Let the reward see each turn's latency: a turn (generation and step) longer than target_s "
        "costs `penalty`; trajectories record turns_over_target, and rollmesh_env_turns_over_target_total counts "
        "them, so a policy can learn to answer within its budget. None: latency does not touch the reward.",
    )
    workflow: WorkflowConfig = Field(
        default_factory=EnvWorkflowConfig,
        description="What an episode is: `env` (default), the environment's reset and steps turn by turn; "
        "`custom` with `path: module:function`, a workflow of your own (docs/workflows.md).",
    )


MAX_TRAJECTORIES = 64  # of one episode: its threads (branches, sub-agents) each become one


async def run_episode(env: Env, seed: int, generate: GenerateFn, tokenizer, config: EpisodeConfig, **kw) -> Trajectory:
    """The episode's trajectory (its first, where a workflow returned several): ``run_trajectories``'."""
    return (await run_trajectories(env, seed, generate, tokenizer, config, **kw))[0]


async def run_trajectories(
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
    observer: RolloutObserver | None = None,
    domain: str = "",
    vision=None,
    image_store: dict[str, bytes] | None = None,
    row: dict | None = None,
    reward_fn=None,
) -> list[Trajectory]:
    """Run one episode by the config's workflow (``rollout/workflows``): its trajectories, the first
    the episode's own, any others its branches (``trajectory_id.k``; a custom workflow's). With a
    ``barrier`` (batch rollout) every turn's generation waits for all episodes' generations, and every
    environment step for all episodes' steps. ``vision``: a vision-language model's
    ``sample_buffer.vision.Vision`` (an environment's images need one); ``image_store`` receives the
    images the trajectories reference, by content hash (its group's). ``row`` and ``reward_fn``: the
    dataset row and the task's reward, for a workflow's ``ctx.row`` and ``ctx.score``."""
    try:
        observer = observer or RolloutObserver()
        ids = {"trajectory_id": trajectory_id, "group_id": group_id, "prompt_id": prompt_id}
        ctx = EpisodeContext(
            env,
            seed,
            generate,
            tokenizer,
            config,
            ids,
            observer,
            vision=vision,
            image_store=image_store,
            barrier=barrier,
            row=row,
            reward_fn=reward_fn,
        )
        t0 = time.monotonic()
        trajectories = await _run(ctx, config.workflow)
        for t in trajectories:
            report(observer.episode_ended, t, time.monotonic() - t0, domain)
        return trajectories
    finally:
        if barrier is not None:
            barrier.leave()
        await close_env(env, config.step_timeout_s)


async def _run(ctx: EpisodeContext, workflow) -> list[Trajectory]:
    if workflow.type == "env":
        try:
            return [await env_episode(ctx)]
        except Ended as e:  # before its first generation
            return [_nothing(ctx, e.finish, e.why)]
    try:
        return _checked(ctx, await workflow.function()(ctx))
    except Ended as e:  # a deadline or the environment, let through by the workflow: what its thread has
        thread = ctx.threads[-1] if ctx.threads else None
        return [thread.trajectory(0.0, e.finish, **e.why) if thread is not None else _nothing(ctx, e.finish, e.why)]
    except Exception as e:  # the user's code: this episode ends, never the worker
        log.warning("%s: workflow %s failed", ctx.trajectory_id, workflow.path, exc_info=True)
        return [
            _nothing(ctx, FinishReason.ENV_ERROR, {"error": f"{type(e).__name__}: {e}"[:500], "error_kind": "workflow"})
        ]


def _checked(ctx: EpisodeContext, out) -> list[Trajectory]:
    """A custom workflow's result: one trajectory, or a list of them, each made by its own thread of
    this episode (the tokens, mask and log-probs it recorded), with a finite reward."""
    out = list(out) if isinstance(out, list | tuple) else [out]
    if not 1 <= len(out) <= MAX_TRAJECTORIES:
        raise WorkflowError(f"returned {len(out)} trajectories; an episode returns 1 to {MAX_TRAJECTORIES}")
    threads = {t.trajectory_id: t for t in ctx.threads}
    seen: set[str] = set()
    for traj in out:
        if not isinstance(traj, Trajectory):
            raise WorkflowError(f"returned {type(traj).__name__}, not a Trajectory (thread.trajectory(reward))")
        if traj.group_id != ctx.ids["group_id"] or traj.prompt_id != ctx.ids["prompt_id"]:
            raise WorkflowError("the trajectory's ids are not this episode's (thread.trajectory keeps them)")
        thread = threads.get(traj.trajectory_id)
        if thread is None:
            raise WorkflowError(f"trajectory_id {traj.trajectory_id!r}: not a thread of this episode")
        if traj.trajectory_id in seen:
            raise WorkflowError(f"trajectory_id {traj.trajectory_id!r}: returned twice (one trajectory a thread)")
        seen.add(traj.trajectory_id)
        logprobs = np.asarray(traj.behavior_logprobs, dtype=np.float32)  # as the data model keeps them
        if not (
            thread.tokens == list(traj.token_ids)
            and thread.mask == list(traj.loss_mask)
            and np.array_equal(np.asarray(thread.logprobs, dtype=np.float32), logprobs)
        ):
            raise WorkflowError("token_ids: not the tokens its thread recorded from the engines")
        if not math.isfinite(traj.reward):
            raise WorkflowError(f"reward: {traj.reward!r} is not a finite number")
    return out


def _nothing(ctx: EpisodeContext, finish: FinishReason, why: dict) -> Trajectory:
    """An episode that ended before anything was generated."""
    return Trajectory(
        **ctx.ids,
        token_ids=[],
        loss_mask=[],
        behavior_logprobs=[],
        token_versions=[],
        reward=0.0,
        start_version=0,
        finish_reason=finish,
        metadata={"env": ctx.env.name, **why},
    )
