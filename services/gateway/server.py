"""The agent gateway: OpenAI's API in front of the LLMProxy, turning agent sessions into groups.

A service of its own rather than routes on the LLMProxy: it holds per-session state (prefix
trees, rewards), a tokenizer and chat template, and an admission slot per group, none of which
the proxy's hot path needs; it scales and restarts on its own; and every generation still goes
through the proxy's ``Generate``, behind the same suspend gate as the EnvManager's.

Routes (``/v1/...`` also under ``/sessions/{id}/v1/...``, so an unmodified OpenAI client only
changes its ``base_url`` to address a session; the header ``x-rollmesh-session`` works too):

    GET  /v1/models                    POST /v1/sessions {group?, group_size?} -> {id, base_url}
    POST /v1/chat/completions          GET  /v1/sessions/{id}
    POST /v1/completions               POST /v1/sessions/{id}/reward {reward}
                                       POST /v1/sessions/{id}/end {reward?}

A request outside any session is served and not recorded. Every route but ``/health`` and
``/metrics`` needs an API key (bearer); errors come in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from rollout.agent.sessions import AgentSessions
from services.body_limit import BodyLimit
from services.gateway.config import GatewayConfig
from services.gateway.error_handlers import install_error_handlers
from services.gateway.guard import Guard
from services.gateway.keys import KeyRing
from services.gateway.metrics import GatewayCollector
from services.gateway.openai_routes import OpenAIRoutes
from services.gateway.session_routes import session_router

log = logging.getLogger(__name__)


def create_app(sessions: AgentSessions, config: GatewayConfig, keys: KeyRing | None) -> FastAPI:
    """``keys`` None: no key is asked for (``auth.disabled``; every caller is ``anonymous``)."""
    app = FastAPI(title="rollmesh agent gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)  # chunked bodies too
    install_error_handlers(app)
    guard = Guard(config, keys)
    app.middleware("http")(guard)
    app.include_router(OpenAIRoutes(sessions, config).router())
    app.include_router(session_router(sessions))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    registry = CollectorRegistry()
    registry.register(GatewayCollector(sessions, guard.counts, guard.in_flight))

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def expire_forever(sessions: AgentSessions, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        if n := await sessions.expire_idle():
            log.info("abandoned %d group(s) with an idle session", n)
