"""The default workflow: an ``Env``'s episode. Reset, then turn after turn: the policy generates, the
environment steps on its text (all episodes of a batch rollout in step with each other at a
barrier), and its observation is the next message, until it is done, a turn limit, or a deadline.
Single-turn, multi-turn, remote providers and vision-language episodes are all this one."""

from __future__ import annotations

import time

from rollout.workflows.context import Ended, EpisodeContext
from sample_buffer.trajectory import FinishReason, Trajectory


async def env_episode(ctx: EpisodeContext) -> Trajectory:
    barrier = ctx.barrier
    thread = await ctx.chat(await ctx.reset())
    penalty = ctx.config.latency_penalty
    reward, finish, why, over_target = 0.0, FinishReason.STOP, {}, 0
    try:
        for _ in range(ctx.config.max_turns):
            t_turn = time.monotonic()
            gen = await thread.generate()
            if barrier is not None:
                await barrier.wait()  # generate all, then step all
            result = await ctx.step(thread.text(gen))
            last = result.done or result.observation is None
            if barrier is not None and not last:
                await barrier.wait()  # step all, then generate the next turn together
            reward += result.reward
            if penalty is not None and time.monotonic() - t_turn > penalty.target_s:  # the turn, as its user waits
                reward -= penalty.penalty
                over_target += 1
            finish = gen.finish_reason
            if last:
                break
            await thread.add(result.role, result.observation)
    except Ended as e:
        finish, why = e.finish, e.why
    return thread.trajectory(
        reward, finish, **why, **({"turns_over_target": over_target} if penalty is not None else {})
    )
