"""``rollmesh serve tinker``: the Tinker training API (the ``tinker`` SDK's REST routes) over
rollmesh's trainer and engines, so a Tinker script or a ``tinker-cookbook`` recipe runs unchanged
with ``ServiceClient(base_url=..., api_key=...)`` against this machine's base model.

Each training client is a LoRA adapter on the one base model the service loads
(``trainer/adapter_pool.py``); its sampler weights are PEFT directories the engine loads by name and
applies per request (SGLang's ``/load_lora_adapter`` and ``lora_path``), so many clients' samples
share one continuous batch.

Wire: JSON everywhere but ``forward_backward``'s body and the results of ``forward_backward`` and
``asample``, which the SDK sends and takes as protobuf only (its own schema, ``services/tinker/wire.py``).
Most calls answer a request id at once; the client then long-polls ``retrieve_future``. Auth: the
SDK's ``X-API-Key`` header, checked before the body is read, against a key file of hashes (one key
per user or team; ``rollmesh gateway-key FILE NAME --tinker``); never the mesh's tokens.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from sample_buffer.errors import raise_if_cancelled
from services.auth import AuthConfig
from services.body_limit import BodyLimit
from services.gateway.keys import KeyRing
from services.tinker import wire
from services.tinker.config import TinkerConfig
from services.tinker.errors import TinkerError
from services.tinker.routes import API, Calls, sampling_router, session_router, training_router
from services.tinker.service import TinkerService

log = logging.getLogger(__name__)
OPEN = ("/health", "/metrics", f"{API}/healthz")
JSON_BODY_BYTES = 8 * 2**20


def error(status: int, message: str, field: str = "") -> JSONResponse:
    # never an empty 400: the SDK takes that for a proxy's hiccup and retries it forever
    return JSONResponse({"detail": message, "field": field}, status_code=status)


def create_app(service: TinkerService, keys: KeyRing | None, max_body_bytes: int) -> FastAPI:
    """``keys`` None: no key is asked for (``auth.disabled``; every caller is ``anonymous``)."""
    app = FastAPI(title="rollmesh Tinker API", docs_url=None, redoc_url=None, openapi_url=None)
    # JSON bodies are small (a sample's prompt is the largest); forward_backward's data is the big one
    app.add_middleware(BodyLimit, max_bytes=JSON_BODY_BYTES, routes={f"{API}/forward_backward": max_body_bytes})
    counts = service.counts

    @app.exception_handler(TinkerError)
    async def _refused(_: Request, e: TinkerError) -> JSONResponse:
        return error(e.status, str(e), e.field)

    @app.exception_handler(wire.WireError)
    async def _malformed(_: Request, e: wire.WireError) -> JSONResponse:
        return error(400, str(e), e.field)  # never a 5xx: the SDK would send it again for minutes

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error(e.status_code, str(e.detail), "body" if e.status_code == 413 else "")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return error(500, f"internal error: {type(e).__name__}: {e}")

    app.add_middleware(KeyCheck, keys=keys, counts=counts)  # outermost: before the body limit reads a byte

    calls = Calls(service, max_body_bytes)
    for router in (session_router(calls), training_router(calls), sampling_router(calls)):
        app.include_router(router)

    @app.get("/metrics")
    async def metrics():
        registry = CollectorRegistry()
        registry.register(_Collector(service))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


class KeyCheck:
    """ASGI middleware: the SDK's ``X-API-Key`` checked before anything else (the body unread); the
    key's name goes to ``request.state.owner``. (Pure ASGI: Starlette's ``BaseHTTPMiddleware`` lost
    the answers of some long polls answered while another poll of the client was in flight.)"""

    def __init__(self, app, keys: KeyRing | None, counts) -> None:
        self.app, self.keys, self.counts = app, keys, counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN:
            return await self.app(scope, receive, send)
        key = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-api-key"), None)
        owner = "anonymous" if self.keys is None else (self.keys.owner(f"Bearer {key}") if key else None)
        if owner is None:
            self.counts[("auth", "refused")] += 1
            response = error(401, "x-api-key: a valid API key is required (the SDK's api_key)", "x-api-key")
            return await response(scope, receive, send)
        scope.setdefault("state", {})["owner"] = owner
        return await self.app(scope, receive, send)


class _Collector:
    def __init__(self, service: TinkerService) -> None:
        self.service = service

    def collect(self):
        s = self.service
        calls = CounterMetricFamily(
            "rollmesh_tinker_calls", "Tinker API calls by route and outcome", labels=["route", "outcome"]
        )
        for (route, outcome), n in sorted(s.counts.items()):
            calls.add_metric([route, outcome], n)
        yield calls
        yield CounterMetricFamily(
            "rollmesh_tinker_trained_tokens", "Tokens through forward/backward", value=s.trained_tokens
        )
        yield CounterMetricFamily("rollmesh_tinker_sampled_tokens", "Tokens sampled", value=s.sampled_tokens)
        for name, value, doc in (
            ("models", len(s.models), "Training models (adapters) held"),
            ("samplers", len(s.samplers), "Sampling sessions open"),
            ("loaded_adapters", len(s._loaded), "Sampler weights the engine holds"),
        ):
            yield GaugeMetricFamily(f"rollmesh_tinker_{name}", doc, value=value)


# ---------------------------------------------------------------------------- the process
def key_ring(config: TinkerConfig, auth: AuthConfig) -> KeyRing | None:
    from services.auth import AuthError

    if auth.disabled:
        log.warning("tinker service: auth.disabled: serving WITHOUT keys; anyone who reaches its port may train")
        return None
    if config.api_keys_path is None:
        raise AuthError(
            "tinker.api_keys_path: no key file; each user needs a key of their own (never the mesh token): issue one "
            "with `rollmesh gateway-key FILE NAME --tinker`"
        )
    return KeyRing(path=config.api_keys_path)


def _start_engine(
    config: TinkerConfig, engine, model_path: str, startup_timeout_s: float, auth: AuthConfig
) -> tuple[object | None, str]:
    """The engine the service samples with: ``tinker.engine_url``, or an embedded one it starts."""
    from pathlib import Path

    from services.engine.backends import backend
    from services.processes import start_engine_process

    if config.engine_url:
        return None, config.engine_url
    if not backend(engine).serves_adapters:
        raise ValueError(
            f"engine.type: {engine.type!r} serves no LoRA adapters as rollmesh starts it (embedded and vllm "
            "engines do); give tinker.engine_url to use an engine started otherwise"
        )
    root = Path(config.root).resolve()
    extra = [f"type={engine.type}", f"load_roots=[{root}]", f"max_loaded_loras={config.max_loaded_adapters}"]
    return start_engine_process(model_path, None, extra, startup_timeout_s, None, auth)


def serve(
    config: TinkerConfig, auth: AuthConfig, model_path: str, engine, device: str, startup_timeout_s: float
) -> None:
    """The Tinker API's section and what it shares with the run: the base model (``model_path``),
    the ``engine`` section (the engine it starts, or the type of ``tinker.engine_url``'s), the
    trainer's ``device`` and how long a started engine may take."""
    from transformers import AutoConfig

    from services.auth import ensure_token
    from services.engine.backends import backend
    from services.grpc_util import serve_until_signal
    from services.llm_proxy.server import engine_client
    from services.processes import stop_process
    from services.uvicorn_serving import start_uvicorn
    from trainer.adapter_pool import AdapterPool

    keys = key_ring(config, auth)  # before anything starts: no key file, no service
    if not config.engine_url:  # its own engine's API takes the control token: one of this process's own if none is set
        ensure_token(auth)
    engine_proc, engine_url = _start_engine(config, engine, model_path, startup_timeout_s, auth)
    if device == "auto":
        device = "cuda" if _cuda() else "cpu"

    async def start():
        pool = await asyncio.to_thread(AdapterPool, model_path, device, config.micro_batch_tokens)
        arch = AutoConfig.from_pretrained(model_path, local_files_only=True).model_type
        serves = backend(engine)  # tinker.engine_url: an engine of the configured type
        client = engine_client(engine_url, auth, serves.api, timeout_s=config.generate_timeout_s)
        max_rank = getattr(engine, "max_lora_rank", None)
        service = TinkerService(config, pool, client, model_path, arch, serves.adapts_lm_head, max_rank)
        app = create_app(service, keys, config.max_body_bytes)
        serving = start_uvicorn(app, config.host, config.port, auth)
        expiry = asyncio.create_task(_expire_forever(service))
        log.info(
            "tinker service on http://%s:%d: base model %r, engine %s",
            config.host,
            config.port,
            service.base_model,
            engine_url,
        )

        async def cleanup() -> None:
            expiry.cancel()
            await service.close()
            await client.close()
            if engine_proc is not None:
                stop_process(engine_proc)

        return serving, cleanup

    try:
        serve_until_signal(start)
    finally:
        if engine_proc is not None:
            stop_process(engine_proc)


async def _expire_forever(service: TinkerService) -> None:
    every = min(30.0, service.config.session_idle_s / 4)
    while True:
        await asyncio.sleep(every)
        try:
            await service.expire()
        except Exception:  # noqa: BLE001 (logged; the next round tries again)
            raise_if_cancelled()
            log.exception("expiring idle sessions failed")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
