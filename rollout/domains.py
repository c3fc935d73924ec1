"""Several task domains in one rollout: which domain's prompt starts next.

A domain is a task with its own rows, environment, reward, sampling and group size (``DomainConfig``).
The loop draws the next domain by weighted turns (``sample_buffer/domains.py``), then that domain's
next prompt in its own shuffled order. The weights are the configured ones divided by each domain's
put rate (the share of its recent groups that reached the buffer): a domain whose groups are often
filtered (every answer right or every answer wrong), failed or stale is drawn more often, so what
reaches the buffer follows the weights, as DAPO's dynamic sampling does for one task. The boost is
bounded (``RolloutConfig.domain_oversampling``): a domain that never puts anything (its reward
service down, say) costs the others a bounded share of the rollouts, not all of them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from rollout.envs.base import Env
from rollout.episode import EpisodeConfig
from rollout.ports import Teacher
from sample_buffer.domains import WeightedTurns

PUT_RATE_MEMORY = 16  # groups: the put rate is a moving average over about this many of a domain's groups


@dataclass
class Domain:
    """A domain as the rollout loop runs it."""

    name: str  # "": the one task of a run without domains
    weight: float  # 0: never rolled out for training (held-out only)
    rows: list[dict]
    make_env: Callable[[str], Env]  # episode id -> a fresh environment
    episode: EpisodeConfig
    group_size: int
    reward_fn: Callable | None = None  # the task's reward, for a workflow's ``ctx.score`` (a remote env: None)
    teacher: Teacher | None = None  # on-policy distillation: scores every group's tokens (``rollout/teachers.py``)

    def prompt_id(self, row: int) -> str:
        return f"{self.name}/p{row}" if self.name else f"p{row}"


class Pick(NamedTuple):
    """A prompt: which domain, which of its rows."""

    domain: str
    row: int


class DomainSampler:
    def __init__(self, domains: list[Domain], seed: int, oversampling: float) -> None:
        self.domains = {d.name: d for d in domains}
        self.oversampling = oversampling
        self._orders: dict[str, list[int]] = {}
        if empty := [d.name for d in domains if d.weight > 0 and not d.rows]:
            raise ValueError(f"domain {empty[0]!r}: no rows to draw prompts from (an empty dataset)")
        for d in domains:
            order = list(range(len(d.rows)))
            # The one task keeps the order it always had; each named domain has its own.
            random.Random(seed if not d.name else f"{seed}:{d.name}").shuffle(order)
            self._orders[d.name] = order
        self._drawn = dict.fromkeys(self.domains, 0)
        trained = {d.name: d.weight for d in domains if d.weight > 0}
        self.turns = WeightedTurns(trained)
        self.put_rate = dict.fromkeys(trained, 1.0)

    def next(self, first_prompt: int = 0) -> Pick:
        """The next prompt; ``first_prompt``: where in each domain's order the walk starts."""
        name = self.turns.draw()
        order, n = self._orders[name], self._drawn[name]
        self._drawn[name] += 1
        return Pick(name, order[(first_prompt + n) % len(order)])

    def ended(self, domain: str, put: bool) -> None:
        """A group of ``domain`` reached the buffer (``put``) or ended without (filtered, failed, stale)."""
        if domain not in self.put_rate:
            return
        rate = self.put_rate[domain] + (float(put) - self.put_rate[domain]) / PUT_RATE_MEMORY
        self.put_rate[domain] = rate
        floor = 1.0 / self.oversampling
        self.turns.reweight({d: self.domains[d].weight / max(r, floor) for d, r in self.put_rate.items()})
