"""The environment interface. It is the multi-turn one even for single-turn tasks: a single-turn
task simply ends (``done``) at its first step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class StepResult:
    observation: str | None  # the next turn's message, None when done
    reward: float
    done: bool
    info: dict = field(default_factory=dict)
    role: str = "user"  # who speaks the observation: "user", or "tool" for a tool's result


class Env(Protocol):
    name: str

    def reset(self, seed: int) -> str:
        """Start an episode; returns the first observation (the user's message)."""

    def step(self, action: str) -> StepResult:
        """Apply the model's decoded response; the reward is computed here, the moment it finishes."""
