"""The AsyncController: policy version, admission control, and suspend → update → resume.

The weight update is a small state machine with a deadline at every step: ``begin_update``
suspends the LLMProxy (in-flight generations are kept as partial and continue after resume);
the trainer then pushes weights through the proxy; ``commit_update`` makes the new version
current and resumes; ``abort_update`` (called by the trainer, or by the watchdog when the
update outlives ``update_timeout_s``) restores the previous weights on every engine and
resumes. Generation never stays suspended because a trainer died mid-update.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rollout.admission import admission_capacity
from rollout.ports import Admitted
from sample_buffer.deadlines import wait_for
from sample_buffer.errors import raise_if_cancelled
from services.controller.config import ControllerConfig
from services.controller.errors import UpdateConflict
from trainer.durable import write_durably
from trainer.ports import Limits

log = logging.getLogger(__name__)
# Trajectories record each token's version as an int32 (sample_buffer.codec): past it, every group failed.
MAX_VERSION = (1 << 31) - 1


class RestoreError(RuntimeError):
    """The saved state cannot be restored (unreadable, or the engines cannot load its weights)."""


@dataclass(frozen=True)
class BufferCount:
    """What admission needs from the SampleBuffer: groups it holds (stored, not consumed), and
    groups it ever stored, which never goes down unless the buffer lost its state."""

    held: int
    stored_total: int


@dataclass
class _Update:
    update_id: str
    new_version: int
    started: float
    watchdog: asyncio.Task | None = None


class AsyncController:
    def __init__(self, config: ControllerConfig, proxy=None, buffer=None) -> None:
        """``proxy``: an object with async ``suspend()``, ``resume()`` and
        ``update_weights(model_path, version)`` (the LLMProxy gRPC client); ``buffer``: one with
        async ``count()`` returning a ``BufferCount``. None for tests of admission alone: then the
        controller counts finished and dropped groups itself."""
        self.config = config
        self.proxy = proxy
        self.buffer = buffer
        self.version = 0
        self.model_path = config.initial_model_path
        # Admitted groups not finished: per named holder as it last reported, plus anonymous callers'.
        self.holders: dict[str, int] = {}
        self._reported: dict[str, float] = {}  # holder -> time.monotonic() of its last report (its lease)
        self._expired: set[str] = set()  # holders whose lease ran out (one that reports again was only cut off)
        self.anonymous = 0
        # Finished groups not yet consumed: as many as the buffer held when last asked, plus those
        # finished since that question was sent (counted twice until the next answer: the safe side).
        self.buffered = 0
        self._unpolled = 0
        self._stored_total: int | None = None  # the buffer's, when last asked
        self.finished = 0  # total, for metrics
        self._poller: asyncio.Task | None = None
        self._reconciler: asyncio.Task | None = None
        self.counters: Counter[str] = Counter()
        self._update: _Update | None = None
        self._lock = asyncio.Lock()
        self._watchers: set[asyncio.Queue] = set()

    # ------------------------------------------------------------------ admission
    @property
    def in_flight(self) -> int:
        return sum(self.holders.values()) + self.anonymous

    def _report(self, holder: str, held: int, returned: int = 0) -> None:
        """A named holder's own count of its groups in flight replaces the controller's; one that
        differs from the controller's (less the ``returned`` groups of this call) is counted."""
        if held < 0:
            raise ValueError(f"held: must be >= 0, got {held}")
        known = self.holders.get(holder)
        if known is not None and known - returned != held:
            self.counters["holder_resyncs"] += 1
        if holder in self._expired:  # it was cut off, not dead: its groups were never lost
            self._expired.discard(holder)
            self.counters["lease_returned"] += held
            if held:
                log.warning("%s reports again after its lease expired, with %d groups in flight", holder, held)
        self.holders[holder] = held
        self._reported[holder] = time.monotonic()

    def _expire_leases(self) -> None:
        """A holder silent for ``holder_lease_s`` died and did not come back under its name (its
        successor would have reported): its groups will never finish, so their slots return."""
        now = time.monotonic()
        for holder, seen in list(self._reported.items()):
            if now - seen > self.config.holder_lease_s:
                del self._reported[holder]
                self._expired.add(holder)
                if lost := self.holders.pop(holder, 0):
                    self.counters["lease_expired"] += lost
                    log.warning(
                        "%s has not reported for %.0f s: its %d admission slots return", holder, now - seen, lost
                    )

    def capacity(self) -> int:
        """Slots free under the bound. Groups consumed are ``version x groups_per_step`` (one step,
        one version), so the count comes from the version and the buffer's own: nothing a lost
        report or a restart of any service could make drift. (Between a step's ack and its
        ``begin_update`` its groups are neither: up to ``groups_per_step`` slots free up that
        early; a group admitted then may miss the bound by a version, and the buffer drops it.)"""
        c = self.config
        # During an update the step that asked for it has consumed its groups already.
        version = self._update.new_version if self._update is not None else self.version
        consumed = version * c.groups_per_step if self.buffer is not None else 0
        done = consumed + self.buffered + self._unpolled
        return admission_capacity(c.async_ratio, self.version, c.groups_per_step, done, self.in_flight)

    async def follow_buffer(self) -> None:
        """Ask the buffer how many groups it holds every ``buffer_poll_s`` (run as a task)."""
        while True:
            sent = self._unpolled
            try:
                count = await wait_for(self.buffer.count(), self.config.control_timeout_s)
            except Exception as e:  # the buffer restarts: keep counting finished groups meanwhile
                raise_if_cancelled()
                self.counters["buffer_poll_failures"] += 1
                log.debug("buffer poll failed: %s", e)
            else:
                self._notice_lost_groups(count)
                self.buffered, self._unpolled = count.held, self._unpolled - sent
            await asyncio.sleep(self.config.buffer_poll_s)

    def _notice_lost_groups(self, count: BufferCount) -> None:
        """A buffer that stored fewer groups in all than when last asked lost its state (the
        in-memory backend restarted, or Redis without its append-only file): the groups it held
        then are gone. At most that many: some may have been consumed since the last question."""
        if self._stored_total is not None and count.stored_total < self._stored_total and self.buffered:
            self.counters["buffer_lost"] += self.buffered
            log.warning(
                "the SampleBuffer lost its state (stored %d in all, %d when last asked): the %d groups it "
                "held are gone",
                count.stored_total,
                self._stored_total,
                self.buffered,
            )
        self._stored_total = count.stored_total

    def start(self) -> AsyncController:
        """Follow the buffer's count and keep the engines at the committed version (tasks)."""
        if self.buffer is not None and self._poller is None:
            self._poller = asyncio.create_task(self.follow_buffer())
        if self.proxy is not None and self._reconciler is None:
            self._reconciler = asyncio.create_task(self._follow_engines())
        return self

    async def _follow_engines(self) -> None:
        while True:
            await asyncio.sleep(self.config.reconcile_s)
            try:
                await self.reconcile()
            except Exception as e:  # the LLMProxy restarts: next time
                raise_if_cancelled()
                self.counters["reconcile_failures"] += 1
                log.warning("bringing the engines to version %d failed: %s", self.version, e)

    async def reconcile(self) -> bool:
        """Engines serving another version than the committed one get its weights; True if sent.
        (A restarted LLMProxy has no record of the last update: an engine that restarted too
        would otherwise serve its initial weights, and every sample it makes would be too stale.)"""
        if self._update is not None or all(v == self.version for v in await self.proxy.served_versions()):
            return False
        async with self._lock:
            if self._update is not None:
                return False
            log.warning("the engines do not all serve version %d: sending them %s", self.version, self.model_path)
            await wait_for(self.proxy.update_weights(self.model_path, self.version), self.config.control_timeout_s)
            self.counters["reconciles"] += 1
            return True

    async def admit(self, num_groups: int, holder: str = "", held: int = 0) -> Admitted:
        if num_groups < 0:
            raise ValueError(f"num_groups: must be >= 0, got {num_groups}")
        if holder:
            self._report(holder, held)
        self._expire_leases()
        granted = min(num_groups, self.capacity())
        if holder:
            self.holders[holder] += granted
        else:
            self.anonymous += granted
        self.counters["admitted"] += granted
        self.counters["admit_refused"] += num_groups - granted
        return Admitted(granted, self.version, self.config.async_ratio)

    async def limits(self) -> Limits:
        """The bound admission runs under, and the current version."""
        return Limits(self.config.async_ratio, self.config.groups_per_step, self.version)

    async def release(
        self, *, unused: int = 0, finished: int = 0, dropped: int = 0, holder: str = "", held: int = 0
    ) -> None:
        if unused < 0 or finished < 0 or dropped < 0:
            raise ValueError("num_groups, num_finished and num_dropped: must be >= 0")
        if not holder and unused + finished > self.anonymous:
            raise ValueError(
                f"num_groups + num_finished = {unused + finished} exceeds the {self.anonymous} groups in flight"
            )
        if self.buffer is None and dropped > self.finished + finished:  # else a restart forgot them
            raise ValueError(f"num_dropped = {dropped} exceeds the {self.finished + finished} finished groups")
        if holder:  # a holder's finished groups count even if a restart lost their admission
            self._report(holder, held, unused + finished)
        else:
            self.anonymous -= unused + finished
        self.finished += finished
        self._unpolled += finished
        if self.buffer is None:  # a finished group dropped untrained (too stale) frees its slot
            self._unpolled -= dropped  # (with a buffer to ask, it is simply no longer there)
        self.counters["released"] += unused
        self.counters["dropped"] += dropped

    # ------------------------------------------------------------------ restarts
    async def restore(self) -> bool:
        """Start where the last committed update left the mesh (``config.state_path``): at its
        version, every engine serving its weights before anything is admitted. False when there
        is nothing to restore (a new run)."""
        path = Path(self.config.state_path or "")
        if not self.config.state_path or not path.exists():
            return False
        try:
            state = json.loads(path.read_text())
            version, model_path = int(state["version"]), str(state["model_path"])
        except (ValueError, KeyError, TypeError) as e:
            raise RestoreError(f"{path}: not a controller state ({e}); delete it to start at version 0") from None
        if self.proxy is not None:
            try:
                await wait_for(self.proxy.update_weights(model_path, version), self.config.control_timeout_s)
            except Exception as e:
                raise RestoreError(
                    f"{path}: cannot bring the engines to version {version} ({model_path}): {e}; "
                    "start over with `rollmesh run --fresh`"
                ) from None
        self.version, self.model_path = version, model_path
        if self.buffer is None:  # counting alone: the groups consumed to reach this version
            self._unpolled = version * self.config.groups_per_step
        self.counters["restores"] += 1
        log.info("restored version %d from %s (engines serve %s)", version, path, model_path)
        return True

    def _save(self) -> None:
        """Keep the committed version where ``restore`` finds it (atomically: a crash mid-write
        leaves the previous state)."""
        if not self.config.state_path:
            return
        path = Path(self.config.state_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_durably(path, json.dumps({"version": self.version, "model_path": self.model_path}))

    # ------------------------------------------------------------------ weight updates
    async def begin_update(self, new_version: int, timeout_s: float = 0.0, supersede: bool = False) -> str:
        """``supersede``: roll back an update in progress first (its trainer died before committing
        it: a restarted trainer would otherwise wait out the dead one's watchdog, minutes)."""
        async with self._lock:
            if self._update is not None and supersede:
                self.counters["updates_superseded"] += 1
                await self._abort(self._update, "superseded: the trainer that began it is gone")
            if self._update is not None:
                raise UpdateConflict(f"update {self._update.update_id} to v{self._update.new_version} is in progress")
            if not self.version < new_version <= MAX_VERSION:
                raise ValueError(
                    f"new_version: must be > current version {self.version} and <= {MAX_VERSION}, got {new_version}"
                )
            # The watchdog sleeps this long: NaN crashed it (uvloop) and infinity disabled it, and either way
            # generation stayed suspended for good if the trainer died mid-update.
            if not 0 <= timeout_s < math.inf:
                raise ValueError(f"timeout_s: must be a finite number >= 0 (0 = the default), got {timeout_s}")
            update = _Update(uuid.uuid4().hex, new_version, time.monotonic())
            if self.proxy is not None:
                await wait_for(self.proxy.suspend(), self.config.control_timeout_s)
            self._update = update
            update.watchdog = asyncio.create_task(self._watchdog(update, timeout_s or self.config.update_timeout_s))
            self.counters["updates_begun"] += 1
            self._notify(suspended=True)
            return update.update_id

    async def commit_update(self, update_id: str, version: int, model_path: str = "") -> int:
        async with self._lock:
            update = self._current(update_id)
            if version != update.new_version:
                raise ValueError(f"version: update {update_id} was begun for v{update.new_version}, got {version}")
            self.version = version
            if model_path:
                self.model_path = model_path
            self._save()
            await self._finish(update, "committed")
            return self.version

    async def abort_update(self, update_id: str, reason: str = "") -> int:
        async with self._lock:
            return await self._abort(self._current(update_id), reason or "aborted by caller")

    async def _abort(self, update: _Update, reason: str) -> int:
        log.warning("weight update to v%d aborted: %s", update.new_version, reason)
        if self.proxy is not None:
            try:  # some engines may already hold the new weights: bring every engine back
                await wait_for(self.proxy.update_weights(self.model_path, self.version), self.config.control_timeout_s)
            except Exception as e:  # reported and counted; generation resumes regardless
                log.error("restoring v%d (%s) failed: %s", self.version, self.model_path, e)
                self.counters["restore_failures"] += 1
        await self._finish(update, "aborted")
        return self.version

    async def _finish(self, update: _Update, result: str) -> None:
        if update.watchdog is not None and update.watchdog is not asyncio.current_task():
            update.watchdog.cancel()
        self._update = None
        self.counters[f"updates_{result}"] += 1
        self.counters["update_seconds_total"] += time.monotonic() - update.started
        if self.proxy is not None:
            try:
                await wait_for(self.proxy.resume(), self.config.control_timeout_s)
            except Exception as e:
                log.error("resume after %s update failed: %s", result, e)
                self.counters["resume_failures"] += 1
        self._notify(suspended=False)

    async def _watchdog(self, update: _Update, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        async with self._lock:
            if self._update is update:
                self.counters["updates_timed_out"] += 1
                await self._abort(update, f"not committed within {timeout_s:.1f}s")

    def _current(self, update_id: str) -> _Update:
        if self._update is None or self._update.update_id != update_id:
            raise UpdateConflict(f"update {update_id!r} is not in progress (it may have timed out and rolled back)")
        return self._update

    # ------------------------------------------------------------------ version stream
    def _notify(self, suspended: bool) -> None:
        for q in self._watchers:
            q.put_nowait((self.version, suspended))

    async def watch_versions(self):
        """Yields the version now and at every change (the rollout loop's ``Admission`` port)."""
        async for version, _ in self.watch():
            yield version

    async def watch(self):
        """Yields (version, suspended) now and at every change."""
        q: asyncio.Queue = asyncio.Queue()
        self._watchers.add(q)
        try:
            yield self.version, self._update is not None
            while True:
                yield await q.get()
        finally:
            self._watchers.discard(q)

    async def close(self) -> None:
        for task in (self._poller, self._reconciler):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._update is not None and self._update.watchdog is not None:
            self._update.watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._update.watchdog
