"""The environment interface. It is the multi-turn one even for single-turn tasks: a single-turn
task simply ends (``done``) at its first step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Observation:
    """An observation with images (a vision-language task's): ``reset`` may return one instead of a
    string, and ``step`` as its ``StepResult.observation``. The images are encoded (PNG, JPEG, WebP,
    GIF) and go before the text, one placeholder each, in the model's own image tokens
    (``sample_buffer/vision.py``)."""

    text: str
    images: tuple[bytes, ...] = ()


@dataclass
class StepResult:
    observation: str | Observation | None  # the next turn's message (with images or not), None when done
    reward: float
    done: bool
    info: dict = field(default_factory=dict)
    role: str = "user"  # who speaks the observation: "user", or "tool" for a tool's result


class Env(Protocol):
    name: str

    def reset(self, seed: int) -> str | Observation:
        """Start an episode; returns the first observation (the user's message, with images or not)."""

    def step(self, action: str) -> StepResult:
        """Apply the model's decoded response; the reward is computed here, the moment it finishes."""
