"""Small code tasks for the ``code`` reward: one-line Python functions a 135M model can learn to
write ("a function add_3(x) that returns x plus 3"), each with its asserts. Generated from
templates with parameters, so a held-out set (another seed, ``--exclude``) has prompts the
training set never showed. HumanEval (``humaneval_data.py``) is the real benchmark; these are
the tasks a CPU run can move.
"""

from __future__ import annotations

import json
import random

SUFFIX = " Answer with the function in a ```python code block."

# (name pattern, signature, description, tests): {k} / {c} / {w} are the task's parameters.
TEMPLATES = [
    ("add_{k}", "x", "returns x plus {k}", ["{n}(0) == {k}", "{n}(5) == 5 + {k}", "{n}(-3) == -3 + {k}"]),
    ("times_{k}", "x", "returns x times {k}", ["{n}(0) == 0", "{n}(2) == 2 * {k}", "{n}(-7) == -7 * {k}"]),
    ("minus_{k}", "x", "returns x minus {k}", ["{n}(0) == -{k}", "{n}(10) == 10 - {k}"]),
    ("square_plus_{k}", "x", "returns the square of x plus {k}", ["{n}(0) == {k}", "{n}(3) == 9 + {k}"]),
    (
        "count_{c}",
        "s",
        "returns how many times the letter '{c}' appears in the string s",
        ["{n}('') == 0", "{n}('{c}{c}x{c}') == 3", "{n}('xyz') == 0"],
    ),
    ("add_{w}", "s", "returns the string s followed by '{w}'", ["{n}('') == '{w}'", "{n}('ab') == 'ab{w}'"]),
    (
        "larger_plus_{k}",
        "a, b",
        "returns the larger of a and b, plus {k}",
        ["{n}(1, 2) == 2 + {k}", "{n}(9, -4) == 9 + {k}", "{n}(3, 3) == 3 + {k}"],
    ),
    (
        "sum_plus_{k}",
        "xs",
        "returns the sum of the numbers in the list xs, plus {k}",
        ["{n}([]) == {k}", "{n}([1, 2, 3]) == 6 + {k}"],
    ),
    (
        "is_multiple_of_{k}",
        "x",
        "returns True if x is a multiple of {k}, else False",
        ["{n}(0) is True", "{n}({k} * 3) is True", "{n}({k} * 3 + 1) is False"],
    ),
    ("repeat_{k}", "s", "returns the string s repeated {k} times", ["{n}('ab') == 'ab' * {k}", "{n}('') == ''"]),
]


def code_task_rows(size: int, seed: int) -> list[dict]:
    """``size`` rows (distinct prompts where the templates allow), each a prompt and its code task."""
    rng = random.Random(seed)
    rows, seen = [], set()
    for _ in range(size * 50):
        if len(rows) == size:
            break
        name, args, desc, tests = rng.choice(TEMPLATES)
        p = {"k": rng.randint(2, 9), "c": rng.choice("aeiou"), "w": rng.choice(["ok", "xy", "no", "yes", "hi"])}
        n = name.format(**p)
        prompt = f"Write a Python function `{n}({args})` that {desc.format(**p)}.{SUFFIX}"
        if prompt in seen:
            continue
        seen.add(prompt)
        checks = "\n".join("assert " + t.format(n=n, **p) for t in tests)
        rows.append({"prompt": prompt, "answer": json.dumps({"task_id": n, "tests": checks}), "task": "code"})
    return rows
