"""A single-turn verifiable task from a JSONL dataset: one prompt, one answer, one verifier."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from rollout.envs.base import StepResult


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
    """``reset(seed)`` picks row ``seed % len(rows)``; ``step`` scores the response and ends."""

    def __init__(self, rows: list[dict], reward_fn: Callable[[str, str], float], name: str = "single_turn") -> None:
        self.rows, self.reward_fn, self.name = rows, reward_fn, name
        self._row: dict | None = None

    def reset(self, seed: int) -> str:
        self._row = self.rows[seed % len(self.rows)]
        return self._row["prompt"]

    def step(self, action: str) -> StepResult:
        if self._row is None:
            raise RuntimeError("step() before reset()")
        reward = float(self.reward_fn(action, self._row["answer"]))
        return StepResult(None, reward, True, {"answer": self._row["answer"]})
