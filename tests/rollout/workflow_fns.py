"""Workflows the workflow tests name by path (``tests.rollout.workflow_fns:NAME``), as a user's
module would hold them."""

from __future__ import annotations

import asyncio
import dataclasses
import math


async def retry_with_critique(ctx):
    """Answer, read a critique, answer again; the reward is the environment's score of the last answer."""
    thread = await ctx.chat(await ctx.reset())
    await thread.generate()
    await thread.add("user", "Check your answer, then give it again.")
    await thread.generate()
    result = await ctx.step(thread.text())
    return thread.trajectory(result.reward, critique_turns=1)


async def raises(ctx):
    thread = await ctx.chat(await ctx.reset())
    await thread.generate()
    raise RuntimeError("the user's bug")


async def returns_nothing(ctx):
    thread = await ctx.chat(await ctx.reset())
    await thread.generate()


async def forges_tokens(ctx):
    """Builds a trajectory whose 'generated' tokens the engine never produced."""
    thread = await ctx.chat(await ctx.reset())
    await thread.generate()
    t = thread.trajectory(1.0)
    ids = list(t.token_ids)
    ids[-1] = (ids[-1] + 1) % 50
    return dataclasses.replace(t, token_ids=ids)


async def nan_reward(ctx):
    thread = await ctx.chat(await ctx.reset())
    await thread.generate()
    return thread.trajectory(math.nan)


async def steps_too_long(ctx):
    """Lets the step's timeout through: the episode ends as a timeout with what was generated."""
    thread = await ctx.chat(await ctx.reset())
    await thread.generate()
    await ctx.step("slow")
    return thread.trajectory(1.0)


def not_async(ctx):
    return None


async def two_args(ctx, row):
    return None


async def scores_itself(ctx):
    """Answers the dataset row's prompt and scores the answer with the task's reward (no env step)."""
    thread = await ctx.chat(ctx.row["prompt"])
    await thread.generate()
    return thread.trajectory(await ctx.score(thread.text()), scored="ctx")


async def branches(ctx):
    """The episode's answer, then two sub-agents asked at once: three trajectories, each scored."""
    main = await ctx.chat(ctx.row["prompt"])
    await main.generate()
    subs = [await ctx.chat(f"{ctx.row['prompt']} (sub-agent {k})") for k in (1, 2)]
    await asyncio.gather(*(s.generate() for s in subs))
    return [t.trajectory(await ctx.score(t.text()), branch=k) for k, t in enumerate([main, *subs])]


async def returns_a_thread_twice(ctx):
    thread = await ctx.chat(await ctx.reset())
    await thread.generate()
    return [thread.trajectory(1.0), thread.trajectory(0.0)]
