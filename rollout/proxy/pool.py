"""The engines behind an LLMProxy and what every part of the proxy shares about them.

One owner for the shared state: the engines (their slots, router and clients), the lanes, the
requests in flight, the counters and the update every engine should serve. The parts
(``generation``, ``control``, ``adapters``, ``updates``, ``health``) each hold this pool and
keep their own state to themselves. The helpers here are the engine calls more than one part
makes: taking an engine out of rotation, one engine's part of an update, a call on every engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path

from rollout.engines.http_engine import EngineRejected, EngineUnavailable
from rollout.proxy.config import ProxyConfig
from rollout.proxy.lanes import Lane
from rollout.proxy.request import InFlight, RequestInvalid
from rollout.proxy.router import EngineSlot, Router
from sample_buffer.deadlines import wait_for

log = logging.getLogger(__name__)

# Why an engine failed a weight update (the ``cause`` label of the failure counter).
_UPDATE_FAILURE_CAUSES = {
    EngineUnavailable: "unavailable",
    EngineRejected: "rejected",
    TimeoutError: "timeout",
    ValueError: "bad_response",
}
UPDATE_FAILURE_CAUSES = ("unavailable", "rejected", "timeout", "bad_response", "version_mismatch", "no_engine")
NO_ENGINE = {
    "engine": "",
    "success": False,
    "weight_version": -1,
    "message": "no engine in rotation",
    "cause": "no_engine",
}


def _root(run: str, folder: str) -> Path:
    """A shared run's adapter folder, resolved once (it must exist: the pool's operator makes it)."""
    try:
        return Path(folder).resolve(strict=True)
    except OSError as e:
        raise ValueError(f"proxy.runs.{run}.adapter_root: {folder} is not a folder here ({e})") from None


def done(slot: EngineSlot, version: int) -> dict:
    """An engine's part of an update that needed no call."""
    return {"engine": slot.name, "success": True, "weight_version": version, "message": "", "cause": ""}


class EnginePool:
    def __init__(self, config: ProxyConfig, client_factory) -> None:
        self.config = config
        slots = [EngineSlot(name=f"engine-{i}", url=u) for i, u in enumerate(config.engine_urls)]
        self.router = Router(slots, config.affinity_capacity)
        self.clients = {s.name: client_factory(s.url, timeout_s=config.request_timeout_s) for s in slots}
        self.base = Lane("")  # the run that owns the engines' weights
        self.lanes = {
            "": self.base,
            **{name: Lane(name, root=_root(name, r.adapter_root)) for name, r in config.runs.items()},
        }
        # by (run, request id): one run's ids never meet another's (nor tell it which are in flight)
        self.in_flight: dict[tuple[str, str], InFlight] = {}
        self.last_update: tuple[str, int] | None = None  # (model_path, version) every engine should serve
        self.counters: Counter[str] = Counter()

    def lane(self, run: str) -> Lane:
        """``run``'s lane ("": the proxy's own); ``RequestInvalid`` naming ``run`` for one it does not serve."""
        lane = self.lanes.get(run)
        if lane is None:
            raise RequestInvalid("run", f"{run!r} is not one of proxy.runs {sorted(self.lanes)[1:]}")
        return lane

    def owns_weights(self, run: str, what: str) -> None:
        """Refuse ``what`` (a call that changes the engines themselves: their weights, memory or
        groups) to a run that shares them."""
        if run:
            raise RequestInvalid(
                "run",
                f"{run!r} shares this proxy's engines: {what} would change them for every run; a shared run "
                "publishes its adapter (train_loop.publisher: {type: disk, adapter: true})",
            )

    def in_rotation(self) -> list[EngineSlot]:
        return [s for s in self.router.engines if s.healthy]

    def take_out(self, slot: EngineSlot, why: str) -> None:
        if slot.healthy:
            log.warning("engine %s (%s) out of rotation: %s", slot.name, slot.url, why)
        slot.healthy = False
        for lane in self.lanes.values():  # it may come back without them (a restarted engine)
            lane.held.pop(slot.name, None)
        slot.failures_total += 1
        self.counters["engine_failures"] += 1

    async def fan_out(self, call, what: str) -> None:
        """``call(client)`` on every engine in rotation; one that fails is taken out."""
        slots = self.in_rotation()
        results = await asyncio.gather(*(call(self.clients[s.name]) for s in slots), return_exceptions=True)
        for s, r in zip(slots, results):
            if isinstance(r, Exception):
                self.take_out(s, f"{what} failed: {r}")

    async def abort_at_engines(self, flights: list[InFlight], timeout: float) -> None:
        """Abort the engine calls of ``flights`` (one whose abort fails ends at its deadline)."""
        calls = [
            self.clients[f.slot.name].abort(f.engine_rid, timeout_s=timeout) for f in flights if f.slot is not None
        ]
        await asyncio.gather(*calls, return_exceptions=True)

    async def engine_update(self, slot: EngineSlot, version: int, applies: bool, timeout: float, call) -> dict:
        """One engine's part of an update; ``applies``: the call must leave it serving ``version``."""
        try:
            res = await wait_for(call(self.clients[slot.name]), timeout)
            got = int(res.get("weight_version", -1)) if applies else slot.weight_version
            slot.weight_version = got
            ok = got == version or not applies
            msg = res.get("message", "") if ok else f"engine reports version {got}, expected {version}"
            cause = "" if ok else "version_mismatch"
            if ok and "received_checksum" in res:  # a collective bucket's, compared by ``updates``
                return {
                    "engine": slot.name,
                    "success": ok,
                    "weight_version": got,
                    "message": msg,
                    "cause": cause,
                    "received_checksum": res["received_checksum"],
                }
        except (EngineUnavailable, EngineRejected, TimeoutError, ValueError) as e:
            ok, got, msg = False, slot.weight_version, f"{type(e).__name__}: {e}"
            cause = _UPDATE_FAILURE_CAUSES.get(type(e), "error")
        return {"engine": slot.name, "success": ok, "weight_version": got, "message": msg, "cause": cause}

    def load_from_disk(self, slot: EngineSlot, path: str, version: int, timeout: float):
        """``slot`` loads the whole weights in ``path`` and must then serve ``version``."""
        return self.engine_update(
            slot, version, True, timeout, lambda c: c.update_weights_from_disk(path, version, timeout_s=timeout)
        )

    async def on_engines(self, call, timeout: float) -> tuple[bool, list[dict]]:
        """``call(client)`` as an update's part on every engine in rotation (no version to confirm)."""
        slots = self.in_rotation()
        results = await asyncio.gather(*(self.engine_update(s, -1, False, timeout, call) for s in slots))
        ok = bool(slots) and all(r["success"] for r in results)
        return ok, (list(results) if slots else [NO_ENGINE])

    def outcome(self, slots: list[EngineSlot], results: list[dict]) -> tuple[bool, list[dict]]:
        """Whether every engine taking part succeeded (none taking part is a failure), counted."""
        ok = bool(slots) and all(r["success"] for r in results)
        if not ok:
            self.counters["weight_update_failures"] += 1
        return ok, (results if slots else [NO_ENGINE])
