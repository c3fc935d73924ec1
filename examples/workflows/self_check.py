"""A workflow of your own (docs/workflows.md): answer, read a prompt to check the answer, answer
again; the reward is the environment's score of the second answer. Both answers are trained on
(each is the policy's), so the policy learns to answer right twice."""

from __future__ import annotations

CHECK = "Check it: which digit is hidden in the string? Answer with that digit."


async def self_check(ctx):
    thread = await ctx.chat(await ctx.reset())
    await thread.generate()
    first = thread.text()
    await thread.add("user", CHECK)
    await thread.generate()
    result = await ctx.step(thread.text())  # the task's reward: the hidden digit's
    return thread.trajectory(result.reward, first_answer=first)
