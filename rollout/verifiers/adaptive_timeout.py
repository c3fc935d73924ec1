"""RollPacker's adaptive sandbox timeout: T = min(max(T_min, λ·T_anchor), T_max).

Correct programs usually end long before a fixed timeout, and the runs that reach it score 0
anyway (RollPacker: 5% of code-sandbox runs hit a 30 s limit). So the limit follows the longest
run time of a correct answer seen so far, ``T_anchor``, per task where the task has had one and
over all tasks otherwise; before any correct answer it is ``T_max``, the fixed limit. A run that
would only have timed out is stopped at λ·T_anchor and scored 0, as it would have been.
"""

from __future__ import annotations

import threading

from pydantic import BaseModel, ConfigDict, Field, model_validator


def adaptive_timeout(anchor_s: float | None, t_min_s: float, t_max_s: float, lam: float) -> float:
    """The slides' formula; with no anchor yet, the fixed limit ``t_max_s``."""
    if anchor_s is None:
        return t_max_s
    return min(max(t_min_s, lam * anchor_s), t_max_s)


class AdaptiveTimeoutConfig(BaseModel):
    """``rollout/verifiers/adaptive_timeout.py``."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="false: every run gets t_max_s (the fixed timeout).")
    t_min_s: float = Field(1.0, gt=0, description="Never stop a run sooner than this, s.")
    t_max_s: float = Field(10.0, gt=0, description="The fixed limit: before any correct answer, and at most, s.")
    lam: float = Field(
        2.0, ge=1.0, description="λ: the limit is this times the longest run time of a correct answer so far."
    )
    per_task: bool = Field(
        True, description="Anchor on the task's own correct answers once it has one (else on all tasks')."
    )

    @model_validator(mode="after")
    def _ordered(self) -> AdaptiveTimeoutConfig:
        if self.t_min_s > self.t_max_s:
            raise ValueError(f"t_min_s ({self.t_min_s}) must not exceed t_max_s ({self.t_max_s})")
        return self


class TimeoutAnchors:
    """The longest correct run time seen, per task and overall; thread-safe."""

    def __init__(self, config: AdaptiveTimeoutConfig) -> None:
        self.config = config
        self.overall: float | None = None
        self.by_task: dict[str, float] = {}
        self._lock = threading.Lock()

    def timeout_for(self, task: str) -> float:
        c = self.config
        if not c.enabled:
            return c.t_max_s
        with self._lock:
            anchor = self.by_task.get(task, self.overall) if c.per_task else self.overall
        return adaptive_timeout(anchor, c.t_min_s, c.t_max_s, c.lam)

    def correct(self, task: str, seconds: float) -> None:
        """A correct answer to ``task`` ran ``seconds``."""
        with self._lock:
            self.overall = max(self.overall or 0.0, seconds)
            self.by_task[task] = max(self.by_task.get(task, 0.0), seconds)
