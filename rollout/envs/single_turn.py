"""A verifiable task from a JSONL dataset: one prompt, one answer, one verifier; with ``tries`` > 1
a wrong answer is told so and answered again, which makes it the smallest multi-turn task. A row
may show images (``images``: data URLs or base64, for a vision-language model)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from rollout.envs.base import Observation, StepResult
from sample_buffer.vision import VisionError, check_image, image_bytes


def load_jsonl(path: str | Path, required: tuple[str, ...] = ("prompt", "answer")) -> list[dict]:
    """Rows of a JSONL file; a clear error names the line and the missing field."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e})") from None
            missing = [k for k in required if k not in row]
            if missing:
                raise ValueError(f"{path}:{i}: missing field {missing[0]!r}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


class SingleTurnEnv:
    """``reset(seed)`` picks row ``seed % len(rows)``; ``step`` scores the response. The episode
    ends at a solved answer (the reward function gives at least ``solved_at``) or after ``tries``
    answers; before that a wrong answer gets ``retry_message`` as the next user turn. The answer
    that ends the episode at try k (from 0) earns its reward times ``retry_discount ** k``, solved
    or not: answering at once is worth more than after being told."""

    def __init__(
        self,
        rows: list[dict],
        reward_fn: Callable[[str, str], float],
        name: str = "single_turn",
        tries: int = 1,
        retry_message: str = "No. Try again.",
        retry_discount: float = 0.5,
        solved_at: float = 1.0,
    ) -> None:
        if tries < 1:
            raise ValueError(f"tries: must be >= 1, got {tries}")
        self.rows, self.reward_fn, self.name = rows, reward_fn, name
        self.tries, self.retry_message = tries, retry_message
        self.retry_discount, self.solved_at = retry_discount, solved_at
        self._row: dict | None = None
        self._try = 0

    def reset(self, seed: int) -> str | Observation:
        i = seed % len(self.rows)
        self._row, self._try = self.rows[i], 0
        images = row_images(self._row, i)  # checked once at load (``TaskConfig.env_factory``); decoded per episode
        return Observation(self._row["prompt"], images) if images else self._row["prompt"]

    def step(self, action: str) -> StepResult:
        if self._row is None:
            raise RuntimeError("step() before reset()")
        reward = float(self.reward_fn(action, self._row["answer"]))
        info = {"answer": self._row["answer"], "tries": self._try + 1}
        if reward >= self.solved_at or self._try + 1 >= self.tries:
            return StepResult(None, reward * self.retry_discount**self._try, True, info)
        self._try += 1
        return StepResult(self.retry_message, 0.0, False, info)


def images_of_rows(rows: list[dict]) -> dict[int, tuple[bytes, ...]]:
    """Each row's ``images`` decoded and their headers read (rows that show any), a bad one naming
    its row: run once at load, so a broken picture stops the start, not an episode mid-run."""
    out = {}
    for i, row in enumerate(rows):
        if images := row_images(row, i):
            out[i] = tuple(check_image(x, f"row {i}: images[{k}]") for k, x in enumerate(images))
    return out


def row_images(row: dict, i: int) -> tuple[bytes, ...]:
    """Row ``i``'s ``images``: data URLs or base64 strings, decoded (their pixels are not)."""
    images = row.get("images")
    if not images:
        return ()
    if not isinstance(images, list):
        raise ValueError(f"row {i}: images: a list of data URLs or base64 strings expected")
    try:
        return tuple(image_bytes(x, f"row {i}: images[{k}]") for k, x in enumerate(images))
    except VisionError as e:
        raise ValueError(str(e)) from None
