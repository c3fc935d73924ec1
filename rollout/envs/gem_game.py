"""Games and puzzles from GEM (``gem-llm`` on PyPI, the environment library ROLL uses), wrapped,
not rewritten: ``game:GuessTheNumber-v0-easy`` (1..10 in 4 turns, told higher or lower),
``game:Mastermind-v0-easy`` and the rest of GEM's text games.

GEM's ``reset`` gives the rules and the first prompt; each ``step`` gives the feedback on one
answer (only the latest: the conversation keeps the history), plus a suffix asking for the next
move. Answers go in ``\\boxed{...}``. GEM rewards a win with 1 and, in some games, pays partial
credit for a loss that came close; ``reward_on_loss`` replaces that where a task wants only wins.

Nothing is downloaded: the number and code games need no data. (GEM's word games fetch NLTK's
word list on first use, and fail on a closed network.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout.envs.base import StepResult


class GemEnvConfig(BaseModel):
    """A GEM game (``rollout/envs/gem_game.py``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["gem"] = Field("gem", description="Selects a game from GEM.")
    env_id: str = Field("game:GuessTheNumber-v0-easy", description="GEM's id of the game (gem.make).")
    reward_on_loss: float | None = Field(
        None, description="Reward of an episode that ended without a win; None keeps GEM's own (partial credit)."
    )
    box_bare_number: bool = Field(
        False,
        description="An answer without \\boxed{} has its first number boxed before GEM reads it (GEM ends the "
        "game on an answer it cannot read; a small model rarely writes \\boxed{} before it has learned to).",
    )

    def build(self, rows=None, reward_fn: Callable | None = None) -> GemEnv:
        return GemEnv(self)


class GemEnv:
    def __init__(self, config: GemEnvConfig) -> None:
        import gem  # an optional dependency: only a process that hosts a GEM game needs it

        self.config, self.name = config, config.env_id
        self.game = gem.make(config.env_id)

    def reset(self, seed: int) -> str:
        obs, info = self.game.reset(seed=seed)
        return _with_suffix(obs, info)

    def step(self, action: str) -> StepResult:
        if self.config.box_bare_number and "\\boxed{" not in action and (n := _NUMBER.search(action)):
            action = f"\\boxed{{{n.group()}}}"
        obs, reward, terminated, truncated, info = self.game.step(action)
        done = bool(terminated or truncated)
        if done and self.config.reward_on_loss is not None and reward < 1.0:
            reward = self.config.reward_on_loss
        return StepResult(None if done else _with_suffix(obs, info), float(reward), done, {"feedback": obs})


_NUMBER = re.compile(r"-?\d+")


def _with_suffix(obs: str, info: dict) -> str:
    suffix = (info or {}).get("suffix")
    return f"{obs}\n{suffix}" if suffix else obs
