"""A *lane*: one training run's requests on an LLMProxy's engines.

The proxy's own lane (``""``) is the run that owns the engines' weights (a full-weight update
changes them for everyone). Each run named in ``proxy.runs`` has a lane of its own on the same
engines: its policy is a LoRA adapter the engines serve by name beside the base weights, so two
runs share one pool without touching each other's weights. A lane has its own suspend gate,
version and adapter; suspending it stops only its requests (the engines keep generating for the
others: SGLang and vLLM pause all requests or none, so a lane never pauses an engine).

An adapter is loaded under a fresh name per update (``run@vN.<proxy tag><k>``), so a failed update
unloads what it loaded and leaves the previous adapter serving; the previous one is unloaded once
the new one is loaded everywhere. An adapter that an engine keeps (in use, or the engine was away,
or a proxy before this one loaded it) is found by its name (``ADAPTER_NAME``) and unloaded later.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

SuspendMode = Literal["continue", "abort", "in_place"]
# How the engines pause for each: ``continue`` aborts at the engines too (the proxy keeps the partial tokens).
ENGINE_PAUSE_MODE = {"continue": "abort", "abort": "abort", "in_place": "in_place"}
ADAPTER_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*@v\d+\.[0-9a-f]{6}\d+$")  # what only lanes name adapters
_TAG = secrets.token_hex(3)  # this proxy's: a restarted proxy's names never meet its predecessor's
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
    root: Path | None = None  # a shared run's adapters must lie below this (proxy.runs.NAME.adapter_root)
    updating: asyncio.Lock = field(default_factory=asyncio.Lock)  # one adapter update at a time
    requests: int = 0
    retries: int = 0

    @property
    def label(self) -> str:
        return self.name or "policy"

    @property
    def suspended(self) -> bool:
        return not self.gate.is_set()

    def adapter_name(self, version: int) -> str:
        """A name no earlier load used: a retried or rolled-back version never meets its old self."""
        return f"{self.label}@v{version}.{_TAG}{next(_NAMES)}"
