"""The LLMProxy: one front door to a pool of inference engines (no sockets of its own).

It is six parts over one shared pool (``pool.py``: the engines, lanes, requests in flight and
counters), each in a file of its own:

- ``generation``: a request from the suspend gate to its end, retried on another engine when
  one fails, continued across a weight update;
- ``control``: suspend and resume, and colocated engines' memory;
- ``updates``: weight updates fanned out to every engine (a directory, buckets, a collective);
- ``adapters``: the LoRA adapters of runs that share the engines, each in a lane of its own
  (``lanes.py``): its requests served with its adapter, its suspend and updates touching only them;
- ``health``: probes; an engine out of rotation rejoins at the mesh's version;
- ``scoring``: the log-probs an engine gives tokens it is handed (a teacher's, in distillation).

``LLMProxy`` builds them and names each verb of its API after the part that owns it.
"""

from __future__ import annotations

import asyncio

from rollout.engines.sglang.client import SGLangClient
from rollout.proxy.adapters import Adapters
from rollout.proxy.config import ProxyConfig
from rollout.proxy.control import Control
from rollout.proxy.generation import Generation
from rollout.proxy.health import Health
from rollout.proxy.pool import EnginePool
from rollout.proxy.scoring import Scoring
from rollout.proxy.updates import WeightUpdates


class LLMProxy:
    def __init__(self, config: ProxyConfig, client_factory=SGLangClient) -> None:
        self.pool = pool = EnginePool(config, client_factory)
        self.config, self.router, self.clients, self.counters = pool.config, pool.router, pool.clients, pool.counters
        self.base, self.lanes, self.in_flight = pool.base, pool.lanes, pool.in_flight
        self.lane, self.owns_weights = pool.lane, pool.owns_weights

        self.generation = Generation(pool)
        self.generate, self.generate_group, self.abort = (
            self.generation.generate,
            self.generation.generate_group,
            self.generation.abort,
        )
        self.control = Control(pool)
        self.suspend, self.resume = self.control.suspend, self.control.resume
        self.release_memory, self.resume_memory = self.control.release_memory, self.control.resume_memory
        self.adapters = Adapters(pool)
        self.updates = WeightUpdates(pool, self.adapters)
        self.update_weights = self.updates.update_weights
        self.update_weights_bucket = self.updates.update_weights_bucket
        self.init_weights_group = self.updates.init_weights_group
        self.update_weights_distributed = self.updates.update_weights_distributed
        self.health = Health(pool, self.adapters)
        self.check_health = self.health.check_health
        self.score = Scoring(pool).score

    async def start(self) -> LLMProxy:
        await self.health.start()
        return self

    async def close(self) -> None:
        self.health.stop()
        await asyncio.gather(*(c.close() for c in self.clients.values()), return_exceptions=True)

    @property
    def suspended(self) -> bool:
        return self.base.suspended

    @property
    def weight_version(self) -> int:
        """The proxy's own run's version."""
        return self.base.version

    def stats(self, run: str = "") -> dict:
        """As ``run`` sees it: its lane's gate, requests and version, and each engine's version of
        its policy (for a lane with an adapter, the adapter's version the engine holds, -1: none)."""
        lane = self.lane(run)
        engines = [vars(s).copy() for s in self.router.engines]
        if lane is not self.base or lane.adapter is not None:
            for e in engines:
                e["weight_version"] = lane.held.get(e["name"], -1) if lane.adapter else lane.version
        if lane is self.base:
            return {
                "suspended": self.suspended,
                "in_flight": len(self.in_flight),
                "requests_total": self.counters["requests"],
                "retries_total": self.counters["retries"],
                "weight_version": lane.version,
                "engines": engines,
            }
        mine = [f for f in self.in_flight.values() if f.lane is lane]
        for e in engines:  # a shared run sees its own requests on each engine, not the others' load
            e |= {"url": "", "outstanding_tokens": 0, "requests_total": 0}
            e["in_flight"] = sum(f.slot is not None and f.slot.name == e["name"] for f in mine)
        return {
            "suspended": self.suspended or lane.suspended,
            "in_flight": len(mine),
            "requests_total": lane.requests,
            "retries_total": lane.retries,
            "weight_version": lane.version,
            "engines": engines,
        }
