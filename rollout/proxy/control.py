"""Suspend and resume, and colocated engines' memory.

Suspension modes decide what happens to in-flight generations during a weight update:
``continue`` aborts them at the engines, keeps the partial tokens and, after ``resume``,
re-submits prompt + partial tokens so they finish under the new weights (the re-prefill costs
little next to waiting for the longest generation to drain); ``abort`` returns them to the
caller as aborted; ``in_place`` pauses the engines with requests inside. A shared run's lane
suspends only its own requests: the engines keep generating for the others.
"""

from __future__ import annotations

import asyncio
import logging
import math

from rollout.proxy.lanes import ENGINE_PAUSE_MODE, Lane, SuspendMode
from rollout.proxy.pool import EnginePool
from rollout.proxy.request import RequestInvalid, check_timeout

log = logging.getLogger(__name__)


class Control:
    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self.lease: asyncio.Task | None = None  # colocated: ends a memory release the trainer never ended

    async def suspend(self, mode: SuspendMode = "continue", timeout_s: float = 0.0, run: str = "") -> int:
        if mode not in ENGINE_PAUSE_MODE:
            raise RequestInvalid("mode", f"must be one of {sorted(ENGINE_PAUSE_MODE)}, got {mode!r}")
        check_timeout(timeout_s)
        lane = self.pool.lane(run)
        if lane is not self.pool.base:
            return await self._suspend_lane(lane, mode, timeout_s)
        lane.mode = mode
        lane.epoch += 1
        lane.gate.clear()
        n = len(self.pool.in_flight)
        timeout = timeout_s or self.pool.config.control_timeout_s
        await self.pool.fan_out(lambda c: c.pause(ENGINE_PAUSE_MODE[mode], timeout_s=timeout), "pause")
        self.pool.counters["suspends"] += 1
        return n

    async def _suspend_lane(self, lane: Lane, mode: SuspendMode, timeout_s: float) -> int:
        """Stop one run's requests, no other's: close its gate and abort its engine calls (``continue``
        re-submits them after ``resume``, with the adapter it then has)."""
        if mode == "in_place":
            raise RequestInvalid(
                "mode",
                f"run {lane.name!r} shares its engines: they pause every request or none (SGLang, vLLM), so a "
                "shared run suspends in continue or abort mode (controller.suspend_mode)",
            )
        lane.mode = mode
        lane.epoch += 1
        lane.gate.clear()
        mine = [f for f in self.pool.in_flight.values() if f.lane is lane]
        timeout = timeout_s or self.pool.config.control_timeout_s
        await self.pool.abort_at_engines(mine, timeout)
        self.pool.counters["suspends"] += 1
        return len(mine)

    async def resume(self, timeout_s: float = 0.0, run: str = "") -> None:
        check_timeout(timeout_s)
        lane = self.pool.lane(run)
        if lane is not self.pool.base:
            lane.gate.set()
            return
        if self.lease is not None:  # the update that follows a memory release resumes: the lease is done
            self.lease.cancel()
            self.lease = None
        timeout = timeout_s or self.pool.config.control_timeout_s
        await self.pool.fan_out(lambda c: c.resume(timeout_s=timeout), "resume")
        self.pool.base.gate.set()

    async def release_memory(self, tags: list[str], lease_s: float, timeout_s: float = 0.0) -> tuple[bool, list[dict]]:
        """Suspend generation (``continue``: partial tokens are kept) and have every engine in
        rotation give back its GPU memory of ``tags`` while a colocated trainer trains. Past
        ``lease_s`` without ``resume_memory`` (a trainer that died), the proxy takes the memory
        back and resumes generation itself: the lease must outlast a step's training."""
        if not lease_s > 0 or not math.isfinite(lease_s):
            raise RequestInvalid("lease_s", f"must be a positive number of seconds, got {lease_s}")
        bad = [t for t in tags if t not in ("weights", "kv_cache")]
        if bad:
            raise RequestInvalid("tags", f"must be weights or kv_cache, got {bad[0]!r}")
        check_timeout(timeout_s)
        timeout = timeout_s or self.pool.config.update_weights_timeout_s
        await self.suspend("continue", timeout_s)
        if self.lease is not None:
            self.lease.cancel()
        self.lease = asyncio.ensure_future(self._lease_ends(lease_s, tags))
        self.pool.counters["memory_releases"] += 1
        return await self.pool.on_engines(
            lambda c: c.release_memory_occupation(tags or None, timeout_s=timeout), timeout
        )

    async def resume_memory(self, tags: list[str], timeout_s: float = 0.0) -> tuple[bool, list[dict]]:
        """Every engine in rotation takes its memory of ``tags`` back, and generation resumes (with
        the weights it had: the weight update that follows suspends it as any other). Resuming at
        once means no failure after this point can leave generation stopped."""
        check_timeout(timeout_s)
        timeout = timeout_s or self.pool.config.update_weights_timeout_s
        res = await self.pool.on_engines(lambda c: c.resume_memory_occupation(tags or None, timeout_s=timeout), timeout)
        await self.resume(timeout_s)
        return res

    async def _lease_ends(self, lease_s: float, tags: list[str]) -> None:
        await asyncio.sleep(lease_s)
        self.lease = None  # (resume would cancel this very task)
        log.warning("colocated engines released for %.0f s with no resume: taking their memory back", lease_s)
        self.pool.counters["memory_lease_expired"] += 1
        await self.resume_memory(tags)
