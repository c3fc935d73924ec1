"""Rollout workflows: the function that *is* an episode.

A workflow is ``async def workflow(ctx) -> Trajectory | list[Trajectory]``: ``ctx``
(``context.EpisodeContext``) holds the episode's ids and dataset row, its environment (``ctx.reset()``,
``ctx.step(action)``, each within its budget), the task's reward (``ctx.score(text)``), the policy
(``ctx.chat(message)`` opens a token-in/token-out ``Thread``: ``thread.generate()``,
``thread.add(role, text)``, ``thread.trajectory(reward)``; each thread after the first is a branch with
its own trajectory), and the budgets. The default, ``env``,
is an ``Env``'s episode (``env.py``); ``custom`` runs a user's own function, named in the config
(``env_manager.episode.workflow: {type: custom, path: module:function}``).

A custom workflow's trajectories must be ones its threads made, with the tokens they recorded and a
finite reward; an exception in its code (or a broken rule) ends the episode as ``env_error`` of
kind ``workflow``, with the traceback in the log, and the worker goes on.
"""

from __future__ import annotations

import inspect
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout.workflows.env import env_episode
from sample_buffer.registry import resolve, tagged_union


class EnvWorkflowConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["env"] = Field("env", description="An Env's episode: reset, then generate and step turn by turn.")


class CustomWorkflowConfig(BaseModel):
    """A user's own episode function, ``async def workflow(ctx) -> Trajectory``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["custom"] = Field("custom", description="Selects a user's own workflow function.")
    path: str = Field(..., description="'module:function' of the workflow (async, one parameter: the context).")

    @field_validator("path")
    @classmethod
    def _importable(cls, path: str) -> str:
        if ":" not in path:
            raise ValueError(f"expected 'module:function', got {path!r}")
        fn = resolve("path", path, {})
        if not inspect.iscoroutinefunction(fn):
            raise ValueError(f"{path} is not an async function (async def workflow(ctx))")
        try:
            inspect.signature(fn).bind(None)
        except TypeError:
            raise ValueError(
                f"{path} does not take one argument, the episode's context: {inspect.signature(fn)}"
            ) from None
        return path

    def function(self):
        return resolve("path", self.path, {})


WorkflowConfig = tagged_union(EnvWorkflowConfig, CustomWorkflowConfig, default="env")

__all__ = ["CustomWorkflowConfig", "EnvWorkflowConfig", "WorkflowConfig", "env_episode"]
