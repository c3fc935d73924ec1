"""Datasets of verifiable tasks from ``reasoning-gym`` (PyPI), written as the JSONL rows a
single-turn environment reads: ``{"prompt", "answer", "task"}``.

reasoning-gym ships procedural generators (arithmetic, chain sums, word problems, puzzles) with a
seed and a difficulty per task: nothing is hand-written and nothing is downloaded. A task draws
item i from seed + i, so the sets of two nearby seeds are the same items shifted: a held-out set
takes a far seed and ``rollmesh make-dataset --exclude TRAIN`` drops any prompt the train set has
(small task spaces repeat prompts even then).
"""

from __future__ import annotations

import json
from pathlib import Path


class DatasetError(ValueError):
    """A task or a task option that reasoning-gym does not have; the message names it."""


def parse_value(text: str):
    """A ``--param`` value: JSON where it parses (numbers, booleans, lists), else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def reasoning_gym_rows(task: str, size: int, seed: int, **options) -> list[dict]:
    import reasoning_gym

    if task not in reasoning_gym.factory.DATASETS:
        near = sorted(n for n in reasoning_gym.factory.DATASETS if task.split("_")[0] in n)[:8]
        raise DatasetError(
            f"--task: reasoning-gym has no task {task!r}" + (f" (similar: {', '.join(near)})" if near else "")
        )
    try:
        data = reasoning_gym.create_dataset(task, size=size, seed=seed, **options)
    except TypeError as e:  # an option the task's config does not take
        raise DatasetError(f"--param: {task} does not take that option ({e})") from None
    except (AssertionError, ValueError) as e:  # the task's own checks of its options
        raise DatasetError(f"--param: {task} refuses these options ({e})") from None
    return [{"prompt": x["question"], "answer": str(x["answer"]), "task": task} for x in data]


def write_jsonl(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
