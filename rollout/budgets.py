"""Latency budgets: how long an environment lets a step, a generation and a whole episode take.

ROLL's "time-in, time-out windows": an environment knows what its users wait for (a sandbox's
step, a tool call, a conversation), so it declares its budgets (an attribute ``budgets`` of the
environment; a remote provider's come with its ``Describe``). The episode's own deadlines
(``EpisodeConfig``: ``step_timeout_s``, ``generation_timeout_s``, ``sampling.max_new_tokens``)
stay the outer limit; the tighter of the two applies, and every call also fits in what is left
of the episode's budget. A missed budget ends the trajectory as ``timeout`` and names it in
``metadata["timeout"]`` (``step``, ``generation``, ``episode``, or ``reset``); nothing waits
past it. The token budget caps each generation (a generation that reaches it ends as ``length``,
like any other length stop).
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from rollout.sampling import SamplingParams


class Budgets(BaseModel):
    """What an environment allows; ``None``: no budget of its own (the episode config's limit)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step_s: float | None = Field(None, gt=0, description="One environment step (its reward included).")
    generation_s: float | None = Field(None, gt=0, description="One turn's generation.")
    generation_tokens: int | None = Field(None, ge=1, description="Tokens one turn's generation may have.")
    episode_s: float | None = Field(None, gt=0, description="The whole episode, reset to last step.")


class EpisodeClock:
    """The deadlines of one episode: each call's timeout, and which budget it is."""

    def __init__(
        self,
        step_timeout_s: float,
        generation_timeout_s: float,
        budgets: Budgets | None = None,
        started: float | None = None,
    ) -> None:
        """``started``: the episode's start (``time.monotonic()``; default now)."""
        self.budgets = budgets or Budgets()
        self._step = _tighter(step_timeout_s, self.budgets.step_s)
        self._generation = _tighter(generation_timeout_s, self.budgets.generation_s)
        started = time.monotonic() if started is None else started
        self._end = started + self.budgets.episode_s if self.budgets.episode_s else None

    def step(self) -> tuple[float, str]:
        """(timeout of the next environment step, the budget that sets it)."""
        return self._within_episode(self._step, "step")

    def generation(self) -> tuple[float, str]:
        return self._within_episode(self._generation, "generation")

    def sampling(self, sampling: SamplingParams) -> SamplingParams:
        cap = self.budgets.generation_tokens
        if cap is None or cap >= sampling.max_new_tokens:
            return sampling
        return sampling.model_copy(update={"max_new_tokens": cap})

    def _within_episode(self, timeout_s: float, name: str) -> tuple[float, str]:
        if self._end is None:
            return timeout_s, name
        left = self._end - time.monotonic()
        return (max(0.0, left), "episode") if left < timeout_s else (timeout_s, name)


def _tighter(limit: float, budget: float | None) -> float:
    return limit if budget is None else min(limit, budget)
