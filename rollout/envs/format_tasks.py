"""Format tasks for the ``word_count`` reward: "Describe the sea in exactly 4 words." The answer is the
count. What they teach is following an instruction's form, a domain beside math and code in a
multi-domain run (``examples/multi-domain.yaml``); templates with parameters, so another seed gives
prompts a training set never showed.
"""

from __future__ import annotations

import random

TOPICS = [
    "the sea", "a cat", "the moon", "winter", "a city at night", "coffee", "a forest", "the rain", "a library",
    "a train", "the desert", "music", "a garden", "the wind", "a mountain", "bread", "a river", "snow", "a bridge",
    "the sun", "a clock", "a market", "the stars", "a dog", "autumn", "a lighthouse", "tea", "a storm", "a book",
    "the morning",
]  # fmt: skip
VERBS = ["Describe", "Summarize", "Say something about", "Write about", "Characterize"]


def format_task_rows(size: int, seed: int) -> list[dict]:
    """``size`` distinct prompts (at most every combination), each with its word count as the answer."""
    rng = random.Random(seed)
    combos = [(v, t, n) for v in VERBS for t in TOPICS for n in range(2, 7)]
    rng.shuffle(combos)
    return [
        {"prompt": f"{verb} {topic} in exactly {n} words.", "answer": str(n), "task": "word_count"}
        for verb, topic, n in combos[:size]
    ]
