"""A *lane*: one training run's requests on an LLMProxy's engines.

The proxy's own lane (``""``) is the run that owns the engines' weights (a full-weight update
changes them for everyone). Each run named in ``proxy.runs`` has a lane of its own on the same
engines: its policy is a LoRA adapter the engines serve by name beside the base weights, so two
runs share one pool without touching each other's weights. A lane has its own suspend gate,
version and adapter; suspending it stops only its requests (the engines keep generating for the
others: SGLang and vLLM pause all requests or none, so a lane never pauses an engine).

An adapter is loaded under a fresh name per update (``run@vN.k``), so a failed update unloads
what it loaded and leaves the previous adapter serving; the previous one is unloaded once the new
one is loaded everywhere.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Literal

SuspendMode = Literal["continue", "abort", "in_place"]
_NAMES = itertools.count()


def _opened() -> asyncio.Event:
    e = asyncio.Event()
    e.set()
    return e


@dataclass(eq=False)
class Lane:
    name: str  # "": the proxy's own run
    version: int = 0  # the policy version its requests are served at
    gate: asyncio.Event = field(default_factory=_opened)  # clear while suspended
    mode: SuspendMode = "continue"
    epoch: int = 0  # bumped by every suspend: tells a segment it was cut by one
    adapter: str | None = None  # the engines' name of the adapter its requests use; None: the base weights
    path: str = ""  # the adapter's directory (an engine that rejoins loads it)
    held: dict[str, int] = field(default_factory=dict)  # engine → version of this lane's adapter it holds

    @property
    def label(self) -> str:
        return self.name or "policy"

    @property
    def suspended(self) -> bool:
        return not self.gate.is_set()

    def adapter_name(self, version: int) -> str:
        """A name no earlier load used: a retried or rolled-back version never meets its old self."""
        return f"{self.label}@v{version}.{next(_NAMES)}"
