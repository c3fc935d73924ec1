"""Response lengths of the simulator: lognormal by median and p99, deterministic per request."""

from __future__ import annotations

import hashlib
import math
import random

from rollout.engines.sim.config import LengthModel

Z99 = 2.3263478740408408  # the standard normal's 99th percentile


def lognormal_sigma(median: float, p99: float) -> float:
    if p99 < median:
        raise ValueError(f"lengths.p99 ({p99}) must be >= lengths.median ({median})")
    return math.log(p99 / median) / Z99


def draw_length(model: LengthModel, key: str, seed: int = 0) -> int:
    """Length of the response identified by ``key``: the same key always gets the same length,
    so a generation aborted by a weight update and continued elsewhere keeps its target."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    x = rng.lognormvariate(math.log(model.median), lognormal_sigma(model.median, model.p99))
    return max(1, min(model.cap, round(x)))


def trailing_run(ids: list[int], token: int) -> int:
    """How many of the last ``ids`` are ``token``: the part of a continued request already generated."""
    n = 0
    for t in reversed(ids):
        if t != token:
            break
        n += 1
    return n
