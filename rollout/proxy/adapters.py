"""The lanes' LoRA adapters on the engines: loading a run's new adapter everywhere, swapping it
in, unloading the old one, and sweeping what an engine holds that no lane serves.

An adapter is loaded under a fresh name per update (``rollout/proxy/lanes.py``), so a failed
update unloads what it loaded and the previous adapter keeps serving. Unloads an engine refuses
(the adapter is still in use) or misses (it was away) are retried by the health loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from rollout.engines.http_engine import EngineRejected, EngineUnavailable
from rollout.proxy.lanes import ADAPTER_NAME, Lane
from rollout.proxy.pool import EnginePool, done
from rollout.proxy.request import RequestInvalid
from rollout.proxy.router import EngineSlot

log = logging.getLogger(__name__)


class Adapters:
    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        engines = [s.name for s in pool.router.engines]
        self.stale: dict[str, set[str]] = {}  # engine → adapters to unload (in use, or its unload failed)
        self.loading: set[str] = set()  # adapters being loaded: never stale
        self.look_again: set[str] = set()  # engines to list the adapters of at the next health round
        self.slot_locks = {name: asyncio.Lock() for name in engines}  # one adapter chore per engine at a time
        self._tidying: dict[str, asyncio.Task] = {}  # the health loop's, per engine

    def rooted(self, lane: Lane, path: str) -> str:
        """``path`` resolved, if it is an existing folder below a shared run's own folder (resolved
        once, at start: a link the run puts in place of its folder later leads nowhere else)."""
        if lane.root is None:
            return path
        try:
            resolved = Path(path).resolve(strict=True) if Path(path).is_absolute() else None
        except OSError:
            resolved = None
        if resolved is None or not resolved.is_relative_to(lane.root):
            raise RequestInvalid(
                "model_path",
                f"must be an existing absolute path below run {lane.name}'s folder {lane.root} "
                f"(proxy.runs.{lane.name}.adapter_root)",
            )
        return str(resolved)  # the engines get no link to follow

    async def update(self, lane: Lane, path: str, version: int, timeout: float) -> tuple[bool, list[dict]]:
        """Every engine in rotation loads the adapter in ``path`` under a new name; once all have (and
        any engine that joined meanwhile), the lane's requests use it and its previous adapter is
        unloaded. Version 0 is the base weights (a new LoRA policy computes what its base does): the
        lane's adapter is dropped. A failure unloads what was loaded and leaves the lane as it was."""
        name = lane.adapter_name(version) if version else None
        slots = self.pool.in_rotation()
        if name is None:
            results = [done(s, version) for s in slots]
        else:
            path = self.rooted(lane, path)
            self.loading.add(name)
            try:
                results = list(await asyncio.gather(*(self.load(s, name, path, version, timeout) for s in slots)))
                ok, results = self.pool.outcome(slots, results)
                late = [s for s in self.pool.router.engines if s.healthy and s not in slots] if ok else []
                for s, r in zip(
                    late, await asyncio.gather(*(self.load(s, name, path, version, timeout) for s in late))
                ):
                    if not r["success"]:
                        self.pool.take_out(s, f"cannot load adapter {name}: {r['message']}")
            except BaseException:  # cancelled midway: any engine may hold it
                self._mark_stale(name, slots)
                raise
            finally:
                self.loading.discard(name)
            if not ok:  # where it loaded, and where a load that timed out here may still land
                maybe = [s for s, r in zip(slots, results) if r["success"] or r["cause"] in ("timeout", "unavailable")]
                await self.unload(name, maybe)
                return ok, results
        await self.swap(lane, name, path, version)
        self.pool.counters["weight_updates"] += 1
        return True, results

    async def swap(self, lane: Lane, name: str | None, path: str, version: int) -> None:
        """Serve ``name`` (None: the base weights) to ``lane`` from now on; unload its previous one.
        An engine away now gets it when it rejoins."""
        old, lane.adapter, lane.path, lane.version = lane.adapter, name, path, version
        lane.held = {s.name: version for s in self.pool.router.engines if s.healthy}
        if old is not None:
            await self.unload(old, self.pool.router.engines)

    async def load(self, slot: EngineSlot, name: str, path: str, version: int, timeout: float) -> dict:
        """One engine's load of a lane's adapter, as ``pool.engine_update`` reports any engine's part."""
        res = await self.pool.engine_update(
            slot, -1, False, timeout, lambda c: c.load_lora_adapter(name, path, timeout_s=timeout)
        )
        res["weight_version"] = version if res["success"] else -1  # the lane's, not the base weights'
        return res

    def _mark_stale(self, name: str, slots: list[EngineSlot]) -> None:
        """``name`` is to be unloaded from those of ``slots`` in rotation (one away is swept when it
        comes back)."""
        for s in slots:
            if s.healthy:
                self.stale.setdefault(s.name, set()).add(name)

    async def unload(self, name: str, slots: list[EngineSlot]) -> None:
        """Unload adapter ``name`` from ``slots``; what an engine keeps is unloaded later."""
        self._mark_stale(name, slots)
        await asyncio.gather(*(self.tidy(s) for s in slots if s.healthy))

    async def tidy(self, slot: EngineSlot, sweep: bool = False) -> None:
        """Unload what ``slot`` should not hold: the adapters marked stale, and with ``sweep`` (or
        after a refusal) every lane's adapter it lists that no lane serves now (a predecessor
        proxy's, one loaded while it was away, one a request was still using)."""
        async with self.slot_locks[slot.name]:
            await self._tidy_locked(slot, sweep)

    async def _tidy_locked(self, slot: EngineSlot, sweep: bool) -> None:
        if sweep or slot.name in self.look_again:
            self.look_again.discard(slot.name)
            try:
                names = await self.pool.clients[slot.name].lora_adapters(self.pool.config.control_timeout_s)
            except (EngineUnavailable, EngineRejected, ValueError) as e:
                log.debug("engine %s: cannot list its adapters (%s)", slot.name, e)
                names = []
                if not sweep:
                    self.look_again.add(slot.name)
            current = {lane.adapter for lane in self.pool.lanes.values()} | self.loading
            stale = {n for n in names if ADAPTER_NAME.match(n) and n not in current}
            self.stale.setdefault(slot.name, set()).update(stale)
        stale = self.stale.get(slot.name, set())
        for name in sorted(stale):
            try:
                await self.pool.clients[slot.name].unload_lora_adapter(
                    name, timeout_s=self.pool.config.control_timeout_s
                )
            except EngineRejected as e:  # still in use (or not there): its list tells, next round
                log.debug("engine %s: adapter %s not unloaded yet (%s)", slot.name, name, e)
                self.pool.counters["adapter_unloads_refused"] += 1
                self.look_again.add(slot.name)
            except (EngineUnavailable, TimeoutError) as e:
                log.info("engine %s: unloading adapter %s later (%s)", slot.name, name, e)
                continue
            stale.discard(name)

    async def reload(self, slot: EngineSlot) -> bool:
        """Bring a rejoining engine every lane's adapter (one that restarted has none; one that only
        missed health checks holds them already: unloaded first), having unloaded the ones it
        holds that no lane serves. False when a load fails, or a lane's adapter changed meanwhile
        (the next health round tries again)."""
        async with self.slot_locks[slot.name]:
            self.stale.pop(slot.name, None)  # what it holds is listed now
            await self._tidy_locked(slot, sweep=True)
            for lane in self.pool.lanes.values():
                adapter, path, version = lane.adapter, lane.path, lane.version
                if adapter is None or lane.held.get(slot.name) == version:
                    continue
                with contextlib.suppress(EngineUnavailable, EngineRejected, TimeoutError):
                    await self.pool.clients[slot.name].unload_lora_adapter(
                        adapter, timeout_s=self.pool.config.control_timeout_s
                    )
                timeout = self.pool.config.update_weights_timeout_s
                if not (await self.load(slot, adapter, path, version, timeout))["success"]:
                    return False
                if lane.adapter != adapter:  # updated while this one loaded: what it got is stale already
                    self.stale.setdefault(slot.name, set()).add(adapter)
                    return False
                lane.held[slot.name] = version
            return True

    def tidy_later(self, slot: EngineSlot) -> None:
        """Start ``slot``'s tidying if it has some to do and none is running (never holding up a
        health round)."""
        chore = self._tidying.get(slot.name)
        if (self.stale.get(slot.name) or slot.name in self.look_again) and (chore is None or chore.done()):
            self._tidying[slot.name] = asyncio.ensure_future(self.tidy(slot))
