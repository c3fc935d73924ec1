"""``http_buckets``: the directory is still written (before generation is suspended) as the restore
point, but the engines get the weights from memory: safetensors buckets of at most ``bucket_mb``,
sent one at a time through the LLMProxy, which forwards each to every engine as it arrives
(``/update_weights_from_safetensors``). While generation is suspended no engine reads a file,
which matters where the run directory is a slow shared filesystem.

``delta: true``: after the first update, the buckets hold only the values that changed in the
engines' dtype since the version they hold (``rollout/engines/weight_delta.py``: indices and
values, or whole tensors where that is smaller), with that version and the checksum of the
result; an engine that holds another version, or whose result has another checksum, refuses (and
keeps its weights), and the publisher then sends every weight within the same deadline.

Engine side (``add_engine_routes``): the embedded engine's ``/update_weights_from_safetensors`` (a
rollmesh extension) stages each bucket and commits with the last.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

import grpc
from fastapi import Query, Request  # the route's annotations are resolved in this module
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from services.convert import project_error
from services.llm_proxy.client import ProxyClient
from services.weight_transports.common import INT64_MAX, INT64_MIN, EngineSide, engine_failures, held_checksum
from services.weight_transports.disk import DiskPublisher
from services.wire_limits import MAX_WEIGHT_BUCKET_MB
from trainer.ports import PublishError

if TYPE_CHECKING:
    from rollout.engines.weight_delta import DeltaStats

log = logging.getLogger(__name__)


class BucketPublisher:
    format = "safetensors"  # what each bucket's bytes hold (WeightBucket.format)
    adapter_format = "safetensors_adapter"  # ... when they hold a LoRA policy's factors

    def __init__(
        self,
        proxy: ProxyClient | None,
        run_dir: str | Path,
        keep_versions: int = 2,
        bucket_mb: int = 256,
        delta_dtype: str | None = None,
        adapter_dtype: str | None = None,
    ) -> None:
        self.proxy, self.max_bytes = proxy, bucket_mb << 20
        # Adapter-only updates of a LoRA policy (``adapter_dtype``: the engines' dtype, what the
        # checksum of the result is computed in): the factors travel, the engines merge them.
        self.adapter_dtype = adapter_dtype
        self.restore = DiskPublisher(proxy, run_dir, keep_versions)
        self._buckets: list[bytes] = []
        # Delta updates (``delta_dtype``: the engines' dtype): the weights every engine holds, as
        # they hold them (the last committed version), and those of the version under way.
        self.delta_dtype = delta_dtype
        self._base: tuple[int, dict] | None = None
        self._pending: tuple[int, dict] | None = None
        self._delta: _Delta | None = None
        self._state: dict = {}  # the exported weights, serialized whole only if a delta fails
        self.delta_fallbacks = 0
        self.stats: dict[str, float] = {}  # what the last load sent (the step's metrics)
        self.delta_stats: DeltaStats | None = None  # what the last load's delta held, if it sent one

    def export(self, engine, version: int) -> str:
        import torch

        from rollout.engines import weight_delta
        from rollout.engines.embedded.weights import weights_checksum

        state = self._gather(engine)  # every rank gathers; rank 0 gets the weights
        factors = engine.adapter_factors() if self.adapter_dtype else {}  # gathered by every rank too
        path = self.restore.export(engine, version, state)
        self._buckets, self._delta, self._state = [], None, {}
        if not path:
            return path
        # Serialized now, before generation is suspended: the suspension only waits for the transfer.
        if self.adapter_dtype is not None and factors:  # (none: nothing adapted, every weight goes)
            checksum = held_checksum(state, self.adapter_dtype)
            buckets = [self._serialize(b) for b in by_layer(factors, self.max_bytes)]
            self._delta = _Delta(self.adapter_format, None, checksum, buckets, None)
            self._state = state
            return path
        if self.delta_dtype is None:
            self._buckets = self._serialize_all(state)
            return path
        held = weight_delta.cast(state, getattr(torch, self.delta_dtype))
        self._pending = (version, held)
        if self._base is None:  # the first update of this trainer: nothing known to hold
            self._buckets = self._serialize_all(state)
            return path
        entries, stats = weight_delta.encode(self._base[1], held)
        buckets = [self._serialize(b) for b in weight_delta.buckets(entries, self.max_bytes)] or [b""]
        self._delta = _Delta("safetensors_delta", self._base[0], weights_checksum(held), buckets, stats)
        self._state = state
        return path

    def _serialize_all(self, state: dict) -> list[bytes]:
        from trainer.export import weight_buckets

        return [self._serialize(b) for b in weight_buckets(state, self.max_bytes)]

    def _gather(self, engine) -> dict:
        return engine.full_weights()

    def _serialize(self, bucket: dict) -> bytes:
        from safetensors.torch import save

        return save(bucket)

    async def load(self, version: int, timeout_s: float) -> None:
        buckets, self._buckets = self._buckets, []
        delta, self._delta = self._delta, None
        state, self._state = self._state, {}  # held only until this update is sent
        deadline = time.monotonic() + timeout_s
        self.stats, self.delta_stats = {}, None
        if delta is not None:
            try:
                await self._send(version, delta.buckets, deadline, timeout_s, delta)
                self.delta_stats = delta.stats
                self.stats = {"weight_update_bytes": sum(map(len, delta.buckets))}
                if delta.stats is not None:
                    self.stats["weight_delta_changed_share"] = delta.stats.changed_share
                self.stats["weight_delta_fallbacks"] = self.delta_fallbacks
                return
            except PublishError as e:  # an engine missed a version, or a check failed: send it all
                self.delta_fallbacks += 1
                log.warning("version %d: the %s update failed (%s); sending every weight", version, delta.format, e)
                from trainer.export import weight_buckets

                # Serialized one at a time as they go (off the event loop): one bucket's bytes at once.
                buckets = list(weight_buckets(state, self.max_bytes))
        if not buckets:
            raise PublishError(f"no weights exported for version {version}")
        sent = await self._send(version, buckets, deadline, timeout_s)
        self.stats = {"weight_update_bytes": sent}  # through the proxy (ipc: the handles)
        if self.delta_dtype is not None or self.adapter_dtype is not None:
            self.stats["weight_delta_fallbacks"] = self.delta_fallbacks

    async def _send(
        self, version: int, buckets: list, deadline: float, timeout_s: float, delta: _Delta | None = None
    ) -> int:
        """Send ``buckets`` (bytes, or tensors serialized on the way) in order; returns the bytes sent."""
        import asyncio

        fmt = self.format if delta is None else delta.format
        extra = {} if delta is None else {"checksum": delta.checksum}
        if delta is not None and delta.base_version is not None:
            extra["base_version"] = delta.base_version
        sent = 0
        for i, bucket in enumerate(buckets):
            if time.monotonic() >= deadline:
                raise PublishError(f"bucket {i} of {len(buckets)}: the {timeout_s:g} s deadline passed")
            data = bucket if isinstance(bucket, bytes) else await asyncio.to_thread(self._serialize, bucket)
            left = deadline - time.monotonic()
            final = i == len(buckets) - 1
            try:
                res = await self.proxy.update_weights_bucket(
                    version, i, data, final, self.restore.path, max(left, 0.001), fmt, **extra
                )
            except grpc.aio.AioRpcError as e:
                raise PublishError(f"LLMProxy, bucket {i} of {len(buckets)}: {project_error(e)}") from None
            if not res.success:
                raise PublishError(f"bucket {i} of {len(buckets)}: {engine_failures(res)}")
            sent += len(data)
        return sent

    def committed(self, version: int) -> None:
        self.restore.committed(version)
        if self._pending is not None and self._pending[0] == version:
            self._base, self._pending = self._pending, None


@dataclass
class _Delta:
    """An update that sends less than every weight: a delta, or a LoRA policy's factors."""

    format: str  # safetensors_delta | safetensors_adapter | tensor_handles_adapter
    base_version: int | None  # a delta: what every engine must hold
    checksum: str  # of the weights after it (weights_checksum, as the engine computes it)
    buckets: list[bytes]
    stats: DeltaStats | None  # a delta's


def by_layer(factors: dict, max_bytes: int):
    """A LoRA policy's factors in buckets of at most ``max_bytes``, each layer's three in one."""
    bucket, size = {}, 0
    for name, t in factors.items():
        n = t.numel() * t.element_size()
        if bucket and size + n > max_bytes and name.endswith(".lora_A"):  # a layer starts with its A
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t.contiguous()
        size += n
    if bucket:
        yield bucket


class BucketPublisherConfig(BaseModel):
    """``http_buckets``: the weights travel in memory through the LLMProxy."""

    model_config = ConfigDict(extra="forbid")
    sends_tensors: ClassVar[bool] = True  # more than a directory: the trainer must hold real weights
    colocates: ClassVar[bool] = True  # works with the trainer and an engine on one GPU
    type: Literal["http_buckets"] = Field(
        "http_buckets", description="Weights travel in memory; the directory is only the restore point."
    )
    bucket_mb: int = Field(
        256,
        ge=1,
        le=MAX_WEIGHT_BUCKET_MB,
        description="Largest bucket in MiB (a bigger tensor travels alone); the proxy holds one at a time.",
    )
    delta: bool = Field(
        False,
        description="Send only the values that changed in the engines' dtype (engine.dtype) since the "
        "version they hold, checked against the whole state's checksum; any failure sends every weight. "
        "Keeps a copy of the weights in that dtype in the trainer's memory (two while an update is under "
        "way). Embedded engines only.",
    )
    adapter: bool = Field(
        False,
        description="A LoRA policy (trainer.lora): send only each adapted layer's factors (bytes in proportion to "
        "the rank); the engines compute the layer's weight from their base as the trainer merges it, checked "
        "against the whole state's checksum; any failure sends every weight. Embedded engines only; not with "
        "delta.",
    )
    # The engines' dtype, the one deltas are made in: engine.dtype's, set when the run config loads.
    _engine_dtype: str = PrivateAttr("float32")

    def build(self, proxy: ProxyClient | None, run_dir: str, keep_versions: int) -> BucketPublisher:
        dtype = self._engine_dtype
        return BucketPublisher(
            proxy,
            run_dir,
            keep_versions,
            self.bucket_mb,
            dtype if self.delta else None,
            dtype if self.adapter else None,
        )


def add_engine_routes(app, side: EngineSide) -> None:
    import asyncio

    from safetensors.torch import load as load_safetensors

    from rollout.engines.contract import EngineError

    engine = side.engine

    @app.post("/update_weights_from_safetensors")  # rollmesh extension
    async def update_weights_from_safetensors(
        request: Request,
        weight_version: int | None = Query(
            None,
            ge=INT64_MIN,
            le=INT64_MAX,
            description="The version the bucket belongs to (the same on every bucket of one update).",
        ),
        final: bool = Query(True, description="Apply everything staged for this version after this bucket."),
        base_version: int | None = Query(
            None,
            ge=INT64_MIN,
            le=INT64_MAX,
            description="A delta update (rollout/engines/weight_delta.py) against this version, which the "
            "engine must hold; absent: the buckets hold every parameter.",
        ),
        checksum: str = Query(
            "", max_length=64, description="A delta's final bucket: the checksum the weights must have after it."
        ),
        adapter: bool = Query(
            False,
            description="An adapter-only update of a LoRA policy (rollout/engines/embedded/adapter_sync.py): the "
            "buckets hold each adapted layer's factors.",
        ),
    ):
        body = await request.body()
        try:
            tensors = load_safetensors(body) if body else {}
        except Exception as e:  # safetensors raises several types for bad bytes
            raise EngineError("body", f"not a safetensors payload ({e})") from None
        if adapter:
            if not hasattr(engine, "stage_adapter"):
                raise EngineError("adapter", "this engine applies no adapter-only updates")
            if weight_version is None or base_version is not None:
                raise EngineError("weight_version", "an adapter update names the version it makes, and no base")
            if final and not checksum:
                raise EngineError("checksum", "an adapter update's final bucket carries the checksum of the result")
            staged = await asyncio.to_thread(engine.stage_adapter, tensors, weight_version) if tensors else 0
            if not final:
                return {"success": True, "staged_tensors": staged}
            res = await asyncio.wrap_future(engine.commit_adapter(weight_version, checksum))
            return {"success": True, "message": "updated from adapters", **res}
        if base_version is not None:
            if not hasattr(engine, "stage_delta"):
                raise EngineError("base_version", "this engine applies no delta updates")
            if weight_version is None:
                raise EngineError("weight_version", "a delta update names the version it makes")
            if final and not checksum:
                raise EngineError("checksum", "a delta's final bucket carries the checksum of the result")
            staged = await asyncio.to_thread(engine.stage_delta, tensors, weight_version, base_version)
            if not final:
                return {"success": True, "staged_tensors": staged}
            res = await asyncio.wrap_future(engine.commit_delta(weight_version, base_version, checksum))
            return {"success": True, "message": "updated from a delta", **res}
        staged = await asyncio.to_thread(engine.stage_tensors, tensors, weight_version) if tensors else 0
        if not final:
            return {"success": True, "staged_tensors": staged}
        res = await asyncio.wrap_future(engine.commit_staged(weight_version))
        return {"success": True, "message": "updated", **res}
