"""Which engine serves a request: least outstanding tokens, with trajectory affinity.

Affinity sends every turn of one episode (same ``route``) to the engine that served the
previous turn, so a prefix cache there (SGLang's radix cache) can reuse the shared prefix. It is
a preference, not a rule: an engine out of rotation loses its affinity.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class EngineSlot:
    """What the router knows about one engine."""

    name: str
    url: str
    healthy: bool = True
    in_flight: int = 0
    outstanding_tokens: int = 0  # prompt + max_new_tokens of requests in flight
    weight_version: int = 0
    requests_total: int = 0
    failures_total: int = 0
    failed_probes: int = 0  # /health probes missed in a row


class Router:
    def __init__(self, engines: list[EngineSlot], affinity_capacity: int = 100_000) -> None:
        if not engines:
            raise ValueError("engine_urls: at least one engine is needed")
        self.engines = engines
        self._affinity: OrderedDict[str, EngineSlot] = OrderedDict()
        self._capacity = affinity_capacity

    def pick(self, affinity_key: str = "", exclude: frozenset[str] = frozenset()) -> EngineSlot | None:
        """The engine for a request, or None when no engine in rotation is left."""
        slot = self._affinity.get(affinity_key) if affinity_key else None
        if slot is not None and slot.healthy and slot.name not in exclude:
            self._affinity.move_to_end(affinity_key)
            return slot
        candidates = [e for e in self.engines if e.healthy and e.name not in exclude]
        if not candidates:
            return None
        slot = min(candidates, key=lambda e: (e.outstanding_tokens, e.in_flight))
        if affinity_key and self._capacity:
            self._affinity[affinity_key] = slot
            self._affinity.move_to_end(affinity_key)
            while len(self._affinity) > self._capacity:
                self._affinity.popitem(last=False)
        return slot
