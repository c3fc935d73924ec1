"""HTTP server of the embedded engine: SGLang's native API, as far as an RL system and SGLang's
own tools use it.

Field names and semantics follow SGLang so the same client (``rollout.engines.sglang.client``)
drives a real SGLang server on GPU and this engine on CPU: ``/generate`` with ``input_ids`` or
``text``, batched or streamed (SSE), SGLang's other request fields accepted as far as the engine
can honour them (``sglang_fields.py``), ``/flush_cache``, ``/health_generate``,
``/get_server_info`` and ``/get_model_info``, and SGLang's memory release for colocation
(``/release_memory_occupation``, ``/resume_memory_occupation``). ``meta_info.output_token_weight_versions``
is a rollmesh extension. Each weight transport adds its own receiving routes
(``services/weight_transports/<name>.py``, ``add_engine_routes``).
"""

from __future__ import annotations

import gc
import sys
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rollout.engines.contract import EngineError
from services.auth import AuthConfig, BearerMiddleware, RefusedCollector, Role, server_bearer
from services.body_limit import BodyLimit
from services.engine.control_routes import control_router
from services.engine.generate_routes import GenerateRoutes
from services.engine.lora_routes import add_lora_routes
from services.engine.metrics import EngineMetrics
from services.http_errors import bad_request, install_error_handlers
from services.http_limits import uvicorn_config
from services.weight_transports import ENGINE_ROUTES
from services.weight_transports.common import INT64_MAX, INT64_MIN, EngineSide
from services.wire_limits import ENGINE_MAX_BODY_BYTES, MAX_WEIGHT_BUCKET_MB

if TYPE_CHECKING:  # its module (the model code, transformers' modeling) only where an embedded engine runs
    from rollout.engines.embedded.engine import EmbeddedEngine


def _version(value: str | int | None) -> int | None:
    if value is None:
        return None
    try:
        version = int(value)
    except ValueError:
        raise EngineError("weight_version", f"must be an integer (rollmesh versions), got {value!r}") from None
    if not INT64_MIN <= version <= INT64_MAX:
        raise EngineError("weight_version", f"must fit in 64 bits, got {version}")
    return version


def create_app(engine: EmbeddedEngine, auth: AuthConfig | None = None, load_roots: list[str] | None = None) -> FastAPI:
    """The engine's API; every route but /health and /metrics needs ``auth``'s token (default:
    from the environment), as SGLang's ``--api-key`` does. ``load_roots``: where
    ``/update_weights_from_disk`` may load from (default: nowhere)."""
    app = FastAPI(title="rollmesh embedded engine")
    install_error_handlers(app)
    # A weight bucket may be 1 GiB; nothing else an engine takes comes near 16 MiB (a /generate of
    # 128k token ids is about 1 MiB of JSON). Counted as it arrives, chunked bodies too.
    bucket_route = {"/update_weights_from_safetensors": (MAX_WEIGHT_BUCKET_MB + 1) << 20}
    app.add_middleware(BodyLimit, max_bytes=ENGINE_MAX_BODY_BYTES, routes=bucket_route)
    bearer = server_bearer(auth or AuthConfig(), "engine", Role.CONTROL)
    if bearer:  # added last: runs first, so a caller without the token is refused before any body
        app.add_middleware(BearerMiddleware, bearer=bearer)
    metrics = EngineMetrics(engine)
    metrics.registry.register(RefusedCollector())

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return bad_request(exc.field, exc.message)

    app.include_router(GenerateRoutes(engine, metrics).router())
    app.include_router(control_router(engine))
    side = EngineSide(engine, _version, load_roots or [])
    for add_routes in ENGINE_ROUTES.values():  # each weight transport's receiving side
        add_routes(app, side)
    add_lora_routes(app, side)

    @app.get("/metrics")
    async def prom_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(engine_config, auth: AuthConfig) -> None:
    """Run the engine server until SIGTERM/SIGINT, then drain and exit 0; https with ``auth.tls``.
    A backend with a server of its own (vLLM, SGLang) runs that one instead (``backends.py``)."""
    from services.engine.backends import backend

    kind = backend(engine_config)
    if kind.engine is None:
        return kind.serve_fn()(engine_config, auth)
    import contextlib
    import signal

    import uvicorn

    class _Server(uvicorn.Server):
        # uvicorn re-raises the captured signal after shutting down (exit code -15); a service
        # that shut down cleanly exits 0 and runs its own clean-up.
        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    # The scheduler thread and the HTTP event loop share the GIL; a short switch interval keeps
    # the loop answering while the scheduler runs Python between kernels (p99 latency).
    sys.setswitchinterval(0.0005)
    engine = kind.build(engine_config).start()  # the embedded engine or the simulator
    # Everything loaded so far (torch, transformers, the model) lives for the whole process;
    # freezing it keeps full GC passes from walking millions of objects (200+ ms pauses).
    gc.freeze()
    try:
        config = uvicorn_config(
            create_app(engine, auth, [engine_config.model_path, *engine_config.load_roots]),
            engine_config.host,
            engine_config.port,
            auth,
        )
        _Server(config).run()
    finally:
        engine.shutdown()
