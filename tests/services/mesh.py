"""The mesh's services in one event loop (the engine runs as its own process), for tests."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import grpc

from rollout.proxy import ProxyConfig
from sample_buffer.config import BufferConfig
from services.controller.config import ControllerConfig
from services.controller.server import start_controller
from services.llm_proxy.client import ProxyClient
from services.llm_proxy.server import start_proxy
from services.pb.rollmesh.v1 import controller_pb2_grpc
from services.sample_buffer.client import BufferClient
from services.sample_buffer.server import start_buffer_service


@contextlib.asynccontextmanager
async def local_mesh(engine_url: str, model_path: str, buffer: dict | None = None, **controller):
    proxy_server, proxy = await start_proxy(ProxyConfig(engine_urls=[engine_url], port=0, metrics_port=0))
    buf_server, buf, refresh = await start_buffer_service(BufferConfig(port=0, metrics_port=0, **(buffer or {})))
    ctl_cfg = ControllerConfig(
        proxy_address=f"127.0.0.1:{proxy_server.bound_port}",
        port=0,
        metrics_port=0,
        initial_model_path=model_path,
        **controller,
    )
    ctl_server, ctl, ctl_proxy = await start_controller(ctl_cfg)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{ctl_server.bound_port}")
    mesh = SimpleNamespace(
        proxy=proxy,
        controller=ctl,
        proxy_client=ProxyClient(f"127.0.0.1:{proxy_server.bound_port}"),
        buffer_client=BufferClient(f"127.0.0.1:{buf_server.bound_port}"),
        controller_stub=controller_pb2_grpc.AsyncControllerStub(channel),
    )
    try:
        yield mesh
    finally:
        for closer in (channel.close(), mesh.proxy_client.close(), mesh.buffer_client.close(), ctl_proxy.close()):
            await closer
        refresh.cancel()
        for server in (ctl_server, buf_server, proxy_server):
            await server.stop(0)
        await ctl.close()
        await buf.close()
        await proxy.close()
