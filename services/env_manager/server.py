"""gRPC EnvManager service: Start / Stop / Stats over an ``EnvManager`` pool."""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.env_manager.config import EnvManagerConfig
from services.env_manager.manager import EnvManager
from services.grpc_util import serve_until_signal, start_server, unary_service
from services.llm_proxy.client import ProxyClient
from services.metrics import serve_metrics
from services.pb.rollmesh.v1 import controller_pb2_grpc
from services.pb.rollmesh.v1 import env_manager_pb2 as pb
from services.sample_buffer.client import BufferClient

log = logging.getLogger(__name__)
SERVICE = "rollmesh.v1.EnvManager"
_FAILURES = ("env_error", "finish_timeout", "groups_filtered", "groups_stale")


def build_handler(manager: EnvManager) -> grpc.GenericRpcHandler:
    async def start(req: pb.StartRequest, ctx) -> pb.StartResponse:
        if req.num_workers < 0:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_workers: must be >= 0")
        await manager.start(req.num_workers)
        return pb.StartResponse(started=True)

    async def stop(req: pb.StopRequest, ctx) -> pb.StopResponse:
        return pb.StopResponse(episodes_abandoned=await manager.stop())

    async def stats(req: pb.EnvStatsRequest, ctx) -> pb.EnvStats:
        c = manager.counters
        return pb.EnvStats(
            running=manager.running,
            workers=len(manager._workers),
            episodes_finished=c["trajectories"],
            trajectories_put=c["groups_put"] * manager.config.group_size,
            groups_put=c["groups_put"],
            failures_by_reason={
                k: v for k, v in c.items() if k in ("env_error", "finish_timeout", "groups_filtered", "groups_stale")
            },
        )

    return unary_service(
        SERVICE,
        {"Start": (pb.StartRequest, start), "Stop": (pb.StopRequest, stop), "Stats": (pb.EnvStatsRequest, stats)},
    )


def serve(config: EnvManagerConfig) -> None:
    async def start():
        proxy, buffer = ProxyClient(config.proxy_address), BufferClient(config.buffer_address)
        channel = grpc.aio.insecure_channel(config.controller_address)
        manager = EnvManager(config, proxy, buffer, controller_pb2_grpc.AsyncControllerStub(channel))
        server = await start_server(build_handler(manager), SERVICE, config.host, config.port)
        serve_metrics(manager.metrics.registry, config.host, config.metrics_port, "EnvManager")
        if config.autostart:
            await manager.start()
        log.info("EnvManager serving on %s:%d", config.host, server.bound_port)

        async def cleanup() -> None:
            await manager.stop()
            await asyncio.gather(proxy.close(), buffer.close(), channel.close())

        return server, cleanup

    serve_until_signal(start)
