"""``http_buckets``: the directory is still written (before generation is suspended) as the restore
point, but the engines get the weights from memory: safetensors buckets of at most ``bucket_mb``,
sent one at a time through the LLMProxy, which forwards each to every engine as it arrives
(``/update_weights_from_safetensors``). While generation is suspended no engine reads a file,
which matters where the run directory is a slow shared filesystem.

Engine side (``add_engine_routes``): the embedded engine's ``/update_weights_from_safetensors`` (a
rollmesh extension) stages each bucket and commits with the last.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import ClassVar, Literal

import grpc
from fastapi import Query, Request  # the route's annotations are resolved in this module
from pydantic import BaseModel, ConfigDict, Field

from services.convert import project_error
from services.llm_proxy.client import ProxyClient
from services.weight_transports.common import INT64_MAX, INT64_MIN, EngineSide, engine_failures
from services.weight_transports.disk import DiskPublisher
from services.wire_limits import MAX_WEIGHT_BUCKET_MB
from trainer.ports import PublishError


class BucketPublisher:
    format = "safetensors"  # what each bucket's bytes hold (WeightBucket.format)

    def __init__(
        self, proxy: ProxyClient | None, run_dir: str | Path, keep_versions: int = 2, bucket_mb: int = 256
    ) -> None:
        self.proxy, self.max_bytes = proxy, bucket_mb << 20
        self.restore = DiskPublisher(proxy, run_dir, keep_versions)
        self._buckets: list[bytes] = []

    def export(self, engine, version: int) -> str:
        from trainer.export import weight_buckets

        state = self._gather(engine)  # every rank gathers; rank 0 gets the weights
        path = self.restore.export(engine, version, state)
        # Serialized now, before generation is suspended: the suspension only waits for the transfer.
        self._buckets = [self._serialize(b) for b in weight_buckets(state, self.max_bytes)] if path else []
        return path

    def _gather(self, engine) -> dict:
        return engine.full_weights()

    def _serialize(self, bucket: dict) -> bytes:
        from safetensors.torch import save

        return save(bucket)

    async def load(self, version: int, timeout_s: float) -> None:
        buckets, self._buckets = self._buckets, []
        if not buckets:
            raise PublishError(f"no weights exported for version {version}")
        deadline = time.monotonic() + timeout_s
        for i, data in enumerate(buckets):
            left = deadline - time.monotonic()
            if left <= 0:
                raise PublishError(f"bucket {i} of {len(buckets)}: the {timeout_s:g} s deadline passed")
            final = i == len(buckets) - 1
            try:
                res = await self.proxy.update_weights_bucket(
                    version, i, data, final, self.restore.path, left, self.format
                )
            except grpc.aio.AioRpcError as e:
                raise PublishError(f"LLMProxy, bucket {i} of {len(buckets)}: {project_error(e)}") from None
            if not res.success:
                raise PublishError(f"bucket {i} of {len(buckets)}: {engine_failures(res)}")

    def committed(self, version: int) -> None:
        self.restore.committed(version)


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

    def build(self, proxy: ProxyClient | None, run_dir: str, keep_versions: int) -> BucketPublisher:
        return BucketPublisher(proxy, run_dir, keep_versions, self.bucket_mb)


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
    ):
        body = await request.body()
        try:
            tensors = load_safetensors(body) if body else {}
        except Exception as e:  # safetensors raises several types for bad bytes
            raise EngineError("body", f"not a safetensors payload ({e})") from None
        staged = await asyncio.to_thread(engine.stage_tensors, tensors, weight_version) if tensors else 0
        if not final:
            return {"success": True, "staged_tensors": staged}
        res = await asyncio.wrap_future(engine.commit_staged(weight_version))
        return {"success": True, "message": "updated", **res}
