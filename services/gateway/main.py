"""`rollmesh serve gateway`: the agent gateway as a process, wired to the mesh's services."""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from rollout.agent.render import TemplateRenderer
from rollout.agent.sessions import AgentSessions
from sample_buffer.vision import vision_of
from services.auth import AuthConfig, AuthError, server_bearer
from services.controller.client import ControllerClient
from services.gateway.config import GatewayConfig
from services.gateway.keys import KeyRing
from services.gateway.server import create_app, expire_forever
from services.grpc_util import serve_until_signal
from services.llm_proxy.client import ProxyClient, ProxyGenerate
from services.mesh_config import MeshConfig
from services.sample_buffer.client import BufferClient
from services.uvicorn_serving import start_uvicorn

log = logging.getLogger(__name__)


def key_ring(config: GatewayConfig, auth: AuthConfig) -> KeyRing | None:
    """The keys the gateway takes: its key file's, never the mesh token (which also updates weights);
    None where ``auth.disabled`` says nobody else can reach the network."""
    if server_bearer(auth, "agent gateway") is None:
        return None
    if config.api_keys_path is None:
        raise AuthError(
            "gateway.api_keys_path: no key file; agents need keys of their own, never the mesh token: "
            "issue one with `rollmesh gateway-key FILE NAME`"
        )
    return KeyRing(path=config.api_keys_path)


def build_sessions(
    config: GatewayConfig, model_path: str, tokenizer_path: str, proxy, buffer, controller
) -> AgentSessions:
    from pathlib import Path

    from transformers import AutoTokenizer

    template = Path(config.chat_template_path).read_text() if config.chat_template_path else None
    # a vision-language model's images are rendered as the trainer's forward reads them
    renderer = TemplateRenderer(AutoTokenizer.from_pretrained(tokenizer_path), template, vision_of(model_path))
    return AgentSessions(config.sessions, renderer, ProxyGenerate(proxy), admission=controller, sink=buffer)


def serve(config: GatewayConfig, auth: AuthConfig, mesh: MeshConfig, model_path: str, put_timeout_s: float) -> None:
    """The gateway's section and what it shares with the run: the mesh's addresses, the policy's
    ``model_path`` (its chat template, unless ``tokenizer_path``) and the SampleBuffer's put deadline."""
    keys = key_ring(config, auth)  # before anything starts: no key file, no gateway

    async def start():
        proxy = ProxyClient(mesh.proxy, auth=auth)
        buffer = BufferClient(mesh.buffer, auth=auth, put_timeout_s=put_timeout_s)
        # Named by where it serves, which a restart keeps: its successor's first report frees the slots
        # of the groups this process had in flight when it died (on port 0 the name is this process's own).
        where = config.port or f"pid{os.getpid()}"
        controller = ControllerClient(mesh.controller, auth=auth, holder=f"{socket.gethostname()}:gateway:{where}")
        tokenizer = config.tokenizer_path or model_path
        sessions = build_sessions(config, model_path, tokenizer, proxy, buffer, controller)
        app = create_app(sessions, config, keys)
        serving = start_uvicorn(app, config.host, config.port, auth)
        lease = asyncio.create_task(controller.keep_lease(5.0))
        expiry = asyncio.create_task(expire_forever(sessions, min(30.0, config.sessions.idle_s / 2)))
        log.info("agent gateway on http://%s:%d (model %r)", config.host, config.port, config.model_name)

        async def cleanup() -> None:
            lease.cancel()
            expiry.cancel()
            await asyncio.gather(proxy.close(), buffer.close(), controller.close())

        return serving, cleanup

    serve_until_signal(start)
