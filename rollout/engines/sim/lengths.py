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


def _rng(key: str) -> random.Random:
    return random.Random(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little"))


def draw_length(model: LengthModel, key: str, seed: int = 0, prompt_key: str = "") -> int:
    """Length of the response identified by ``key``: the same key always gets the same length,
    so a generation aborted by a weight update and continued elsewhere keeps its target. With
    ``model.prompt_share`` above 0, part of the draw is the prompt's (``prompt_key``), shared by
    every response to it; the marginal distribution stays the same lognormal."""
    rng, sigma = _rng(f"{seed}:{key}"), lognormal_sigma(model.median, model.p99)
    if not model.prompt_share:
        x = rng.lognormvariate(math.log(model.median), sigma)
    else:
        share = model.prompt_share
        z = math.sqrt(share) * _rng(f"{seed}:prompt:{prompt_key}").normalvariate(0.0, 1.0)
        z += math.sqrt(1 - share) * rng.normalvariate(0.0, 1.0)
        x = model.median * math.exp(sigma * z)
    return max(1, min(model.cap, round(x)))


def trailing_run(ids: list[int], token: int) -> int:
    """How many of the last ``ids`` are ``token``: the part of a continued request already generated."""
    n = 0
    for t in reversed(ids):
        if t != token:
            break
        n += 1
    return n
