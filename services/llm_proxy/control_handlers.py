"""The LLMProxy's control RPCs: suspend and resume, the weight updates (a directory, buckets, the
collective's group and its buckets), colocated engines' memory, and stats. Calls that change the
engines themselves are the proxy's owner's only."""

from __future__ import annotations

import grpc

from services.llm_proxy.calls import ProxyCalls, refusals
from services.pb.rollmesh.v1 import llm_proxy_pb2 as pb
from services.wire_limits import MAX_WEIGHT_BUCKET_MB

MODES = {
    pb.SUSPEND_MODE_UNSPECIFIED: "continue",
    pb.SUSPEND_MODE_CONTINUE: "continue",
    pb.SUSPEND_MODE_ABORT: "abort",
    pb.SUSPEND_MODE_IN_PLACE: "in_place",
}


class ControlHandlers(ProxyCalls):
    async def suspend(self, req: pb.SuspendRequest, ctx) -> pb.SuspendResponse:
        if req.mode not in MODES:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"mode: unknown suspend mode {req.mode}")
        async with refusals(ctx):
            n = await self.proxy.suspend(MODES[req.mode], req.timeout_s, self.run_of(ctx))
            return pb.SuspendResponse(num_in_flight=n)

    async def resume(self, req: pb.ResumeRequest, ctx) -> pb.ResumeResponse:
        async with refusals(ctx):
            await self.proxy.resume(req.timeout_s, self.run_of(ctx))
        return pb.ResumeResponse()

    async def update_weights(self, req: pb.UpdateWeightsRequest, ctx) -> pb.UpdateWeightsResponse:
        if not req.adapter:
            await self.owner_only(ctx, "a full-weight update")
        async with refusals(ctx):
            with self.metrics.update_seconds.time():
                ok, results = await self.proxy.update_weights(
                    req.model_path, req.weight_version, req.timeout_s, self.run_of(ctx), req.adapter
                )
        self.metrics.observe_update(ok, results)
        return pb.UpdateWeightsResponse(success=ok, engines=[pb.EngineUpdateResult(**r) for r in results])

    async def update_weights_bucket(self, pieces, ctx) -> pb.UpdateWeightsResponse:
        await self.owner_only(ctx, "an in-memory weight update")
        req, data = await receive_bucket(pieces, ctx)
        async with refusals(ctx):
            ok, results = await self.proxy.update_weights_bucket(
                req.weight_version,
                req.index,
                data,
                req.final,
                req.restore_path,
                req.timeout_s,
                req.format,
                req.base_version,
                req.checksum,
            )
        if req.final or not ok:  # the update ended
            self.metrics.observe_update(ok, results)
        return pb.UpdateWeightsResponse(success=ok, engines=[pb.EngineUpdateResult(**r) for r in results])

    async def init_weights_group(self, req: pb.InitWeightsGroupRequest, ctx) -> pb.InitWeightsGroupResponse:
        await self.owner_only(ctx, "a weight-update group")
        async with refusals(ctx):
            world, engines = await self.proxy.init_weights_group(
                req.master_address, req.master_port, req.group_name, req.backend, req.timeout_s
            )
        return pb.InitWeightsGroupResponse(world_size=world, engines=engines)

    async def update_weights_distributed(self, req: pb.DistributedBucket, ctx) -> pb.UpdateWeightsResponse:
        await self.owner_only(ctx, "a collective weight update")
        async with refusals(ctx):
            ok, results = await self.proxy.update_weights_distributed(
                req.weight_version,
                req.index,
                [t.name for t in req.tensors],
                [t.dtype for t in req.tensors],
                [list(t.shape) for t in req.tensors],
                req.final,
                req.restore_path,
                req.checksum,
                req.timeout_s,
                req.adapter,
                req.result_checksum,
            )
        if req.final or not ok:
            self.metrics.observe_update(ok, results)
        return pb.UpdateWeightsResponse(success=ok, engines=[pb.EngineUpdateResult(**r) for r in results])

    async def release_memory(self, req: pb.MemoryRequest, ctx) -> pb.MemoryResponse:
        await self.owner_only(ctx, "releasing memory")
        async with refusals(ctx):
            ok, results = await self.proxy.release_memory(list(req.tags), req.lease_s, req.timeout_s)
        return pb.MemoryResponse(success=ok, engines=[pb.EngineUpdateResult(**r) for r in results])

    async def resume_memory(self, req: pb.MemoryRequest, ctx) -> pb.MemoryResponse:
        await self.owner_only(ctx, "taking memory back")
        async with refusals(ctx):
            ok, results = await self.proxy.resume_memory(list(req.tags), req.timeout_s)
        return pb.MemoryResponse(success=ok, engines=[pb.EngineUpdateResult(**r) for r in results])

    async def stats(self, req: pb.StatsRequest, ctx) -> pb.ProxyStats:
        s = self.proxy.stats(self.run_of(ctx))
        engines = [
            pb.EngineStats(
                name=e["name"],
                url=e["url"],
                healthy=e["healthy"],
                in_flight=e["in_flight"],
                outstanding_tokens=e["outstanding_tokens"],
                weight_version=e["weight_version"],
                requests_total=e["requests_total"],
                failures_total=e["failures_total"],
            )
            for e in s.pop("engines")
        ]
        return pb.ProxyStats(**s, engines=engines)


async def receive_bucket(pieces, ctx) -> tuple[pb.WeightBucket, bytearray]:
    """A bucket's pieces: the first's fields and all their ``safetensors`` bytes, grown in place (a
    large bytearray grows by remapping, not copying: about one bucket in memory, not two); refused
    as soon as they pass MAX_WEIGHT_BUCKET_MB."""
    first, data = None, bytearray()
    async for piece in pieces:
        if first is None:
            first = piece
        elif any(field.name != "safetensors" for field, _ in piece.ListFields()):
            await ctx.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "WeightBucket: a later piece carries more than safetensors"
            )
        if len(data) + len(piece.safetensors) > MAX_WEIGHT_BUCKET_MB << 20:
            await ctx.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"safetensors: a bucket is at most {MAX_WEIGHT_BUCKET_MB} MiB"
            )
        data += piece.safetensors
    if first is None:
        await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "WeightBucket: no message")
    first.ClearField("safetensors")
    return first, data
