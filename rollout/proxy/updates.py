"""Weight updates fanned out to the engines: a whole directory, an update in buckets (bytes, tensor
handles, or a collective broadcast from the trainer), and the collective's group.

An update succeeds only if every engine in rotation confirms its version; an engine that came
into rotation midway loads the version's directory instead, and one out of rotation is brought
to it before it rejoins (``health``). Any failure ends the update: the trainer rolls back and
starts again from bucket 0. A shared run's update is its adapter (``adapters``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

from rollout.proxy.adapters import Adapters
from rollout.proxy.pool import EnginePool
from rollout.proxy.request import RequestInvalid, check_timeout
from rollout.proxy.router import EngineSlot
from sample_buffer.deadlines import wait_for

log = logging.getLogger(__name__)

# What a WeightBucket's bytes hold ("" is safetensors).
BUCKET_FORMATS = (
    "",
    "safetensors",
    "safetensors_delta",
    "safetensors_adapter",
    "tensor_handles",
    "tensor_handles_adapter",
)
# Formats whose final bucket carries the checksum of the weights the update makes.
CHECKED_FORMATS = ("safetensors_delta", "safetensors_adapter", "tensor_handles_adapter")


@dataclass
class _BucketUpdate:
    version: int
    slots: list[EngineSlot]  # the engines in rotation when bucket 0 arrived
    next_index: int = 0


@dataclass
class _GroupPlan:
    """A weight-update group the trainer hosts: its members and their joins (answered once every
    rank, the trainer's included, has joined)."""

    name: str
    slots: list[EngineSlot]
    joined: asyncio.Task


def _group_ranks(slot: EngineSlot, info) -> int:
    """The ranks an engine takes in a weight-update group: its tensor-parallel size. An engine
    whose server info cannot be read counts as one (its join then fails or times out, and the
    update with it)."""
    try:
        if isinstance(info, BaseException):
            raise ValueError(info)
        return max(1, int(info.get("tp_size", 1)))
    except (TypeError, ValueError) as e:
        log.warning("engine %s: no tensor-parallel size (%s); counting 1 rank", slot.name, e)
        return 1


class WeightUpdates:
    def __init__(self, pool: EnginePool, adapters: Adapters) -> None:
        self.pool, self.adapters = pool, adapters
        self.bucket_update: _BucketUpdate | None = None  # an in-memory update under way
        self.group: _GroupPlan | None = None  # the collective transport's group, once planned

    async def update_weights(
        self, model_path: str, version: int, timeout_s: float = 0.0, run: str = "", adapter: bool = False
    ) -> tuple[bool, list[dict]]:
        """Load ``model_path`` on every engine in rotation; succeed only if all confirm ``version``.
        ``adapter``: it is a LoRA adapter (PEFT's directory) the engines serve by name to ``run``'s
        requests, over unchanged base weights; a run that shares the engines publishes nothing else.

        Engines out of rotation are brought to this version before they rejoin (health loop).
        """
        if not model_path:
            raise RequestInvalid("model_path", "must not be empty")
        check_timeout(timeout_s)
        timeout = timeout_s or self.pool.config.update_weights_timeout_s
        lane = self.pool.lane(run)
        if adapter:
            async with lane.updating:  # two at once could end on the older one
                return await self.adapters.update(lane, model_path, version, timeout)
        self.pool.owns_weights(run, "a full-weight update")
        self.bucket_update = None  # a whole directory supersedes an in-memory update under way
        slots = self.pool.in_rotation()
        results = await asyncio.gather(*(self.pool.load_from_disk(s, model_path, version, timeout) for s in slots))
        return await self._updated(slots, list(results), model_path, version)

    async def update_weights_bucket(
        self,
        version: int,
        index: int,
        data: bytes | bytearray,
        final: bool,
        restore_path: str,
        timeout_s: float = 0.0,
        fmt: str = "",
        base_version: int = 0,
        checksum: str = "",
    ) -> tuple[bool, list[dict]]:
        """Forward one bucket of an in-memory update (``http_buckets``) to every engine taking part.

        Bucket 0 starts the update: the engines in rotation then take part. The final bucket makes
        them apply it and, like ``update_weights``, succeeds only if every engine in rotation
        confirms ``version``; an engine that came into rotation midway loads ``restore_path``
        instead. Any failure ends the update: the caller rolls back and starts again from bucket 0.
        ``fmt``: what ``data`` holds, safetensors bytes (default), a delta in safetensors against
        ``base_version`` whose result has ``checksum`` (``safetensors_delta``), a LoRA policy's
        factors whose result has ``checksum`` (``safetensors_adapter``), or ``tensor_handles`` (``ipc``;
        ``tensor_handles_adapter``: handles to those factors).
        """
        if fmt not in BUCKET_FORMATS:
            raise RequestInvalid("format", f"must be one of {', '.join(BUCKET_FORMATS[1:])}, got {fmt!r}")
        if fmt in CHECKED_FORMATS and final and not checksum:
            raise RequestInvalid("checksum", f"a {fmt} update's final bucket carries the checksum of the result")

        def send(c, timeout: float):
            if fmt.startswith("tensor_handles"):
                extra = {"adapter": True, "checksum": checksum} if fmt == "tensor_handles_adapter" else {}
                payload = data.decode("ascii")
                return c.update_weights_from_tensor(payload, version if final else None, timeout_s=timeout, **extra)
            if fmt == "safetensors_delta":
                return c.update_weights_from_safetensors(
                    data, version, final, timeout_s=timeout, base_version=base_version, checksum=checksum
                )
            if fmt == "safetensors_adapter":
                return c.update_weights_from_safetensors(
                    data, version, final, timeout_s=timeout, adapter=True, checksum=checksum
                )
            return c.update_weights_from_safetensors(data, version, final, timeout_s=timeout)

        return await self._bucket(version, index, final, restore_path, timeout_s, send, "")

    async def init_weights_group(
        self, master_address: str, master_port: int, group_name: str, backend: str, timeout_s: float = 0.0
    ) -> tuple[int, list[str]]:
        """Plan a weight-update group hosted by the trainer (rank 0) at ``master_address:master_port``
        over the engines in rotation, each taking as many ranks as its tensor-parallel size, and
        start their joins. Returns the group's world size (for the trainer's own join, which
        completes the group) and its engines."""
        if not master_address:
            raise RequestInvalid("master_address", "must not be empty")
        if master_address not in self.pool.config.weight_group_hosts:  # the group's store is not authenticated
            raise RequestInvalid(
                "master_address",
                f"{master_address!r} is not one of proxy.weight_group_hosts {self.pool.config.weight_group_hosts}",
            )
        if not 1 <= master_port <= 65535:
            raise RequestInvalid("master_port", f"must be in [1, 65535], got {master_port}")
        if not group_name:
            raise RequestInvalid("group_name", "must not be empty")
        if backend not in ("gloo", "nccl"):
            raise RequestInvalid("backend", f"must be gloo or nccl, got {backend!r}")
        check_timeout(timeout_s)
        timeout = timeout_s or self.pool.config.update_weights_timeout_s
        if self.group is not None:
            self.group.joined.cancel()
        slots = self.pool.in_rotation()
        if not slots:
            raise RequestInvalid("engines", "no engine in rotation to join a weight-update group")
        infos = await asyncio.gather(
            *(self.pool.clients[s.name].server_info(self.pool.config.control_timeout_s) for s in slots),
            return_exceptions=True,
        )
        ranks = [_group_ranks(s, i) for s, i in zip(slots, infos)]
        offsets = list(itertools.accumulate([1, *ranks]))
        world = offsets[-1]
        joins = [
            self.pool.engine_update(
                s,
                -1,
                False,
                timeout,
                lambda c, off=off: c.init_weights_update_group(
                    master_address, master_port, off, world, group_name, backend, timeout_s=timeout
                ),
            )
            for s, off in zip(slots, offsets)
        ]
        self.group = _GroupPlan(group_name, slots, asyncio.ensure_future(asyncio.gather(*joins)))
        return world, [s.name for s in slots]

    async def update_weights_distributed(
        self,
        version: int,
        index: int,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        final: bool,
        restore_path: str,
        checksum: str,
        timeout_s: float = 0.0,
        adapter: bool = False,
        result_checksum: str = "",
    ) -> tuple[bool, list[dict]]:
        """One bucket of a collective update (the ``collective`` transport): every engine of the
        group receives the tensors the trainer broadcasts. Like ``update_weights_bucket``, and
        each engine's ``checksum`` of what it received must match the trainer's where it reports one.
        ``adapter``: the tensors are a LoRA policy's factors, and the final bucket's result must have
        ``result_checksum``."""
        if not names or not len(names) == len(dtypes) == len(shapes):
            raise RequestInvalid("tensors", "at least one tensor, each with a name, a dtype and a shape")
        if adapter and final and not result_checksum:
            raise RequestInvalid(
                "result_checksum", "an adapter update's final bucket carries the checksum of the result"
            )
        group = self.group
        if group is None:
            raise RequestInvalid("group_name", "no weight-update group: InitWeightsGroup first")
        check_timeout(timeout_s)
        timeout = timeout_s or self.pool.config.update_weights_timeout_s
        if index == 0:  # the trainer joined, so every engine's join is answering now
            try:
                if group.joined.cancelled():  # superseded by a newer InitWeightsGroup
                    raise TimeoutError
                joined = await wait_for(asyncio.shield(group.joined), timeout)
            except TimeoutError:
                joined = [
                    {
                        "engine": s.name,
                        "success": False,
                        "weight_version": s.weight_version,
                        "cause": "timeout",
                        "message": "did not join the weight-update group",
                    }
                    for s in group.slots
                ]
            ok, results = self.pool.outcome(group.slots, list(joined))
            if not ok:
                self.group = None
                return ok, results

        def send(c, timeout: float):
            extra = {"adapter": True, "checksum": result_checksum} if adapter else {}
            return c.update_weights_from_distributed(
                names, dtypes, shapes, group.name, version if final else None, timeout_s=timeout, **extra
            )

        return await self._bucket(version, index, final, restore_path, timeout_s, send, checksum, group.slots)

    async def _bucket(
        self,
        version: int,
        index: int,
        final: bool,
        restore_path: str,
        timeout_s: float,
        send,
        checksum: str,
        members: list[EngineSlot] | None = None,
    ) -> tuple[bool, list[dict]]:
        """One bucket of an update that travels in pieces: ``send(client, timeout)`` forwards it to
        every engine taking part (``members``, default: those in rotation at bucket 0)."""
        check_timeout(timeout_s)
        if index == 0:
            self.bucket_update = _BucketUpdate(version, members or self.pool.in_rotation())
        update = self.bucket_update
        if update is None or update.version != version or update.next_index != index:
            expected = "0" if update is None else f"{update.next_index} of version {update.version}"
            raise RequestInvalid(
                "index",
                f"bucket {index} of version {version} does not continue the update under "
                f"way (expected bucket {expected})",
            )
        if final and not restore_path:
            raise RequestInvalid("restore_path", "the final bucket must name a directory holding the version")
        timeout = timeout_s or self.pool.config.update_weights_timeout_s
        calls = [self.pool.engine_update(s, version, final, timeout, lambda c: send(c, timeout)) for s in update.slots]
        results = list(await asyncio.gather(*calls))
        for r in results:
            got = r.pop("received_checksum", checksum)
            if r["success"] and checksum and got != checksum:
                r.update(success=False, cause="checksum", message="received bytes differ from the trainer's")
        update.next_index += 1
        if not final:
            ok, results = self.pool.outcome(update.slots, results)
            if not ok:
                self.bucket_update = None
            return ok, results
        self.bucket_update = None
        late = [s for s in self.pool.router.engines if s.healthy and s not in update.slots]
        results += await asyncio.gather(*(self.pool.load_from_disk(s, restore_path, version, timeout) for s in late))
        return await self._updated(update.slots + late, results, restore_path, version)

    async def _updated(
        self, slots: list[EngineSlot], results: list[dict], path: str, version: int
    ) -> tuple[bool, list[dict]]:
        """The end of a full-weight update: ``version`` is the mesh's only if every engine confirmed
        it, and the proxy's own requests are served by these weights, with no adapter."""
        ok, results = self.pool.outcome(slots, results)
        if ok:
            self.pool.last_update = (path, version)
            self.pool.base.version = version
            self.pool.counters["weight_updates"] += 1
            if self.pool.base.adapter is not None:
                async with self.pool.base.updating:  # not racing an adapter update of its own
                    await self.adapters.swap(self.pool.base, None, "", version)
        return ok, results
