"""Engine health: a probe of every engine each round; an engine that misses enough probes is out
of rotation, and one that answers again rejoins only at the mesh's weight version, with every
lane's adapter and in the mesh's suspend state."""

from __future__ import annotations

import asyncio
import logging

from rollout.engines.http_engine import EngineRejected, EngineUnavailable, int_version
from rollout.proxy.adapters import Adapters
from rollout.proxy.lanes import ENGINE_PAUSE_MODE
from rollout.proxy.pool import EnginePool
from rollout.proxy.router import EngineSlot
from sample_buffer.errors import raise_if_cancelled

log = logging.getLogger(__name__)


class Health:
    def __init__(self, pool: EnginePool, adapters: Adapters) -> None:
        self.pool, self.adapters = pool, adapters
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """The first round, the engines' versions and a sweep of old adapters, then the loop."""
        pool = self.pool
        await self.check_health()
        # A proxy (re)started in front of engines that were updated before serves their version,
        # and resumes them, as it resumes an engine that rejoins: a predecessor killed between a
        # weight update's pause and its resume left them paused, and nothing else would resume them.
        infos = await asyncio.gather(*(self._read_version(s) for s in pool.in_rotation()))
        versions = {s.weight_version for s in pool.in_rotation()}
        if len(versions) == 1:
            pool.base.version = versions.pop()
        await asyncio.gather(*(self._resume(s, info) for s, info in zip(pool.in_rotation(), infos) if info))
        # what a predecessor proxy loaded for its lanes is no lane's now
        await asyncio.gather(*(self.adapters.tidy(s, sweep=True) for s in pool.in_rotation()))
        self._task = asyncio.create_task(self._loop())

    def stop(self) -> None:
        if self._task:
            self._task.cancel()

    async def check_health(self) -> None:
        await asyncio.gather(*(self._probe(s) for s in self.pool.router.engines))

    async def _read_version(self, slot: EngineSlot) -> dict | None:
        try:
            info = await self.pool.clients[slot.name].model_info(self.pool.config.health_check_timeout_s)
            slot.weight_version = int_version(info.get("weight_version"))
            return info
        except (EngineUnavailable, EngineRejected, ValueError) as e:
            self.pool.take_out(slot, f"model info failed: {e}")
            return None

    async def _resume(self, slot: EngineSlot, info: dict) -> None:
        """``slot`` generating again, unless a colocated trainer holds its memory (the trainer's
        ResumeMemory resumes it); one that refuses stays in rotation, as it was."""
        if info.get("memory_released"):
            return
        try:
            await self.pool.clients[slot.name].resume(timeout_s=self.pool.config.control_timeout_s)
        except (EngineUnavailable, EngineRejected, ValueError, TimeoutError) as e:
            log.warning("engine %s: not resumed at start: %s", slot.name, e)

    async def _probe(self, slot: EngineSlot) -> None:
        pool, config = self.pool, self.pool.config
        client = pool.clients[slot.name]
        if not await client.health(config.health_check_timeout_s):
            slot.failed_probes += 1
            if slot.healthy and slot.failed_probes >= config.health_failures_to_remove:
                pool.take_out(slot, f"{slot.failed_probes} health checks failed in a row")
            return
        slot.failed_probes = 0
        if slot.healthy:
            self.adapters.tidy_later(slot)
            return
        try:  # rejoin only at the mesh's weight version, and in the mesh's suspend state
            info = await client.model_info(config.health_check_timeout_s)
            slot.weight_version = int_version(info.get("weight_version"))
            if pool.last_update and slot.weight_version != pool.last_update[1]:
                res = await pool.load_from_disk(slot, *pool.last_update, config.update_weights_timeout_s)
                if not res["success"]:
                    return
            if not await self.adapters.reload(slot):
                return
            if pool.base.suspended:
                await client.pause(ENGINE_PAUSE_MODE[pool.base.mode], timeout_s=config.control_timeout_s)
            else:
                await client.resume(timeout_s=config.control_timeout_s)
        except (EngineUnavailable, EngineRejected, ValueError):
            return
        log.info("engine %s (%s) back in rotation", slot.name, slot.url)
        slot.healthy = True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.pool.config.health_check_interval_s)
            try:
                await self.check_health()
            except Exception:  # the loop must outlive any single probe
                raise_if_cancelled()  # but not its own stop
                log.exception("health check round failed")
