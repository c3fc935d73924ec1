"""An environment provider's servers: rollmesh's gRPC ``EnvProvider`` and OpenEnv's HTTP contract
in one process, both thin adapters over ``ProviderSessions``.

HTTP follows OpenEnv (``openenv-core``'s ``http_server.py``): ``POST /reset {seed?, episode_id?}``
and ``POST /step {action, timeout_s?, request_id?}`` answer ``{observation, reward, done}``;
``GET /state``, ``GET /health``, ``GET /metadata``; and the WebSocket ``/ws``, where each
connection is one episode (OpenEnv's own client speaks only this for episodes that last more
than one call). OpenEnv's REST server builds a fresh environment per request, so its
``/step`` cannot continue an episode; here REST sessions are keyed by ``episode_id`` (a field
OpenEnv's request models allow), so both ways keep state. The action is
``{"content": "<the model's text>"}``; the observation ``{"content": ..., "role": "user"|"tool"}``.

Every route but ``/health`` and ``/metrics`` needs the bearer token, the WebSocket's handshake too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import uuid

import grpc
from fastapi import FastAPI, Query, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field

from rollout.envs.remote import Observation
from sample_buffer.vision import data_url
from services.auth import AuthConfig, BearerMiddleware, RefusedCollector, provider_auth, server_bearer
from services.body_limit import BodyLimit
from services.env_provider.config import EnvProviderConfig
from services.env_provider.sessions import ProviderSessions, SessionError
from services.grpc_util import serve_until_signal, start_server, unary_service
from services.http_errors import bad_request, install_error_handlers
from services.http_limits import uvicorn_config
from services.pb.rollmesh.v1 import env_provider_pb2 as pb
from services.reward.ports import reward_ports

log = logging.getLogger(__name__)
SERVICE = "rollmesh.v1.EnvProvider"
GRPC_STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "busy": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "timeout": grpc.StatusCode.DEADLINE_EXCEEDED,
    "env": grpc.StatusCode.FAILED_PRECONDITION,
}
HTTP_STATUS = {"invalid": 400, "not_found": 404, "busy": 503, "timeout": 504, "env": 500}


def build_sessions(
    config: EnvProviderConfig, auth: AuthConfig | None = None, reward_address: str | None = None
) -> ProviderSessions:
    """``reward_address``: the mesh's reward service, for ``reward: {type: service}`` naming none."""
    _, _, make_env = config.env_factory(**reward_ports(auth, reward_address=reward_address))
    return ProviderSessions(
        make_env,
        config.env.type,
        max_sessions=config.max_sessions,
        step_timeout_s=config.step_timeout_s,
        session_idle_s=config.session_idle_s,
        max_action_chars=config.max_action_chars,
    )


def _timeout(value: float | None) -> float:
    if value is not None and not (0 <= value < math.inf):
        raise SessionError("invalid", "timeout_s", f"must be a finite number >= 0 (0: the provider's), got {value}")
    return value or 0.0


# ---------------------------------------------------------------- gRPC
def grpc_handler(sessions: ProviderSessions) -> grpc.GenericRpcHandler:
    async def call(ctx, coro):
        try:
            return await coro
        except SessionError as e:
            await ctx.abort(GRPC_STATUS[e.code], str(e))

    async def describe(req: pb.DescribeRequest, ctx) -> pb.DescribeResponse:
        info = sessions.describe()
        budgets = pb.Budgets(**{k: v for k, v in (info.budgets.model_dump() if info.budgets else {}).items() if v})
        return pb.DescribeResponse(
            name=info.name, idempotent_steps=info.idempotent_steps, max_sessions=sessions.max_sessions, budgets=budgets
        )

    async def reset(req: pb.ResetRequest, ctx) -> pb.ResetResponse:
        obs = await call(ctx, sessions.reset(req.episode_id, req.seed))
        return pb.ResetResponse(episode_id=req.episode_id, observation=obs.content, role=obs.role, images=obs.images)

    async def step(req: pb.StepRequest, ctx) -> pb.StepResponse:
        async def run() -> Observation:
            return await sessions.step(req.episode_id, req.action, req.request_id, _timeout(req.timeout_s))

        obs = await call(ctx, run())
        return pb.StepResponse(
            observation=obs.content,
            reward=obs.reward,
            done=obs.done,
            role=obs.role,
            info_json=json.dumps(obs.info, default=str),
            images=obs.images,
        )

    async def close(req: pb.CloseRequest, ctx) -> pb.CloseResponse:
        await sessions.close(req.episode_id)
        return pb.CloseResponse()

    return unary_service(
        SERVICE,
        {
            "Describe": (pb.DescribeRequest, describe),
            "Reset": (pb.ResetRequest, reset),
            "Step": (pb.StepRequest, step),
            "Close": (pb.CloseRequest, close),
        },
    )


# ---------------------------------------------------------------- HTTP (OpenEnv)
class ResetReq(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenEnv lets environments take their own reset options

    seed: int | None = Field(None, ge=0, description="Seed of the episode (which task row, which game).")
    episode_id: str | None = Field(None, description="The episode's id; one is made when absent (and answered).")


class Action(BaseModel):
    model_config = ConfigDict(extra="forbid")

    content: str = Field(..., description="The model's decoded response.")


class StepReq(BaseModel):
    model_config = ConfigDict(extra="allow")

    action: Action
    episode_id: str = Field("", description="The episode to step (REST keeps one session per episode id).")
    timeout_s: float | None = Field(None, ge=0, description="How long the caller waits.")
    request_id: str = Field("", description="A repeated request id is answered again, not applied twice.")


class CloseReq(BaseModel):
    model_config = ConfigDict(extra="forbid")

    episode_id: str


def _openenv(obs: Observation, reset: bool = False) -> dict:
    """OpenEnv's ``{observation, reward, done}``; the info rides in the observation's ``info``."""
    body = {"content": obs.content, "role": obs.role, **({"info": obs.info} if obs.info else {})}
    if obs.images:  # as data URLs, where the clients' image_key reads them
        body["images"] = [data_url(x) for x in obs.images]
    return {"observation": body, "reward": None if reset else obs.reward, "done": obs.done}


def _error(e: SessionError) -> JSONResponse:
    response = bad_request(e.field, str(e).split(": ", 1)[1])
    response.status_code = HTTP_STATUS[e.code]
    return response


def create_app(sessions: ProviderSessions, auth: AuthConfig) -> FastAPI:
    app = FastAPI(title="rollmesh environment provider", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    registry = CollectorRegistry()
    registry.register(_Collector(sessions))
    registry.register(RefusedCollector())
    # An action's characters escaped in JSON (at most 6 bytes each) and the request's other fields.
    app.add_middleware(BodyLimit, max_bytes=6 * sessions.max_action_chars + 65_536)
    bearer = server_bearer(auth, "environment provider")
    if bearer:  # added last: runs first, so a caller without the token is refused before any body
        app.add_middleware(BearerMiddleware, bearer=bearer)

    @app.exception_handler(SessionError)
    async def _session_error(_, e: SessionError) -> JSONResponse:
        return _error(e)

    @app.post("/reset")
    async def reset(req: ResetReq | None = None):
        req = req or ResetReq()
        episode_id = req.episode_id or uuid.uuid4().hex
        obs = await sessions.reset(episode_id, req.seed or 0)
        return {**_openenv(obs, reset=True), "episode_id": episode_id}

    @app.post("/step")
    async def step(req: StepReq):
        obs = await sessions.step(req.episode_id, req.action.content, req.request_id, _timeout(req.timeout_s))
        return _openenv(obs)

    @app.post("/close")
    async def close(req: CloseReq):
        return {"closed": await sessions.close(req.episode_id)}

    @app.get("/state")
    async def state(episode_id: str = Query(...)):
        return sessions.state(episode_id)

    @app.get("/health")
    async def health():
        return {"status": "healthy"}

    @app.get("/metadata")
    async def metadata():
        info = sessions.describe()
        return {
            "name": info.name,
            "description": f"rollmesh environment {info.name!r}",
            "idempotent_steps": info.idempotent_steps,
            "max_sessions": sessions.max_sessions,
            "budgets": info.budgets.model_dump(exclude_none=True) if info.budgets else {},
        }

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.websocket("/ws")
    async def ws(socket: WebSocket):
        await socket.accept()
        episode_id = f"ws-{uuid.uuid4().hex}"
        try:
            while True:
                await socket.send_text(json.dumps(await _ws_answer(sessions, episode_id, await socket.receive_text())))
        except WebSocketDisconnect:
            pass
        finally:
            await sessions.close(episode_id)

    return app


async def _ws_answer(sessions: ProviderSessions, episode_id: str, raw: str) -> dict:
    """One OpenEnv WebSocket message → its answer: ``observation``, ``state`` or ``error``."""
    try:
        msg = json.loads(raw)
        if not isinstance(msg, dict):
            raise SessionError("invalid", "message", "expected a JSON object")
        data = msg.get("data") or {}
        if not isinstance(data, dict):
            raise SessionError("invalid", "data", "expected a JSON object")
        match msg.get("type"):
            case "reset":
                seed = data.get("seed") or 0
                if not isinstance(seed, int) or seed < 0:
                    raise SessionError("invalid", "data.seed", f"expected an integer >= 0, got {seed!r}")
                await sessions.close(episode_id)  # a second reset starts the connection's episode anew
                return {"type": "observation", "data": _openenv(await sessions.reset(episode_id, seed), reset=True)}
            case "step":
                content = data.get("content")
                if not isinstance(content, str):
                    raise SessionError("invalid", "data.content", "expected the action's text")
                return {"type": "observation", "data": _openenv(await sessions.step(episode_id, content))}
            case "state":
                return {"type": "state", "data": sessions.state(episode_id)}
            case "close":
                await sessions.close(episode_id)
                return {"type": "state", "data": {"episode_id": episode_id, "closed": True}}
            case other:
                raise SessionError("invalid", "type", f"unknown message type {other!r} (reset, step, state, close)")
    except json.JSONDecodeError as e:
        return {"type": "error", "data": {"message": f"Invalid JSON: {e}", "code": "INVALID_JSON"}}
    except SessionError as e:
        return {"type": "error", "data": {"message": str(e), "code": e.code.upper(), "field": e.field}}


class _Collector:
    """The provider's Prometheus metrics, read from its sessions at scrape time."""

    def __init__(self, sessions: ProviderSessions) -> None:
        self.sessions = sessions

    def collect(self):
        yield GaugeMetricFamily("rollmesh_provider_sessions", "Episodes hosted now", value=len(self.sessions.sessions))
        calls = CounterMetricFamily("rollmesh_provider_events", "Resets, steps and failures by kind", labels=["event"])
        for event, n in sorted(self.sessions.counters.items()):
            calls.add_metric([event], n)
        yield calls


# ---------------------------------------------------------------- the process
def serve(config: EnvProviderConfig, auth: AuthConfig, reward_address: str | None = None) -> None:
    """Serve gRPC on ``grpc_port`` and HTTP on ``http_port`` until SIGTERM or SIGINT."""
    import uvicorn

    mesh_auth, auth = auth, provider_auth(auth, config.token_env)  # callers send the provider's own token

    async def start():
        sessions = build_sessions(config, mesh_auth, reward_address)
        server = await start_server(grpc_handler(sessions), SERVICE, config.host, config.grpc_port, auth=auth)
        http = uvicorn.Server(
            uvicorn_config(
                create_app(sessions, auth),
                config.host,
                config.http_port,
                auth,
                ws="websockets-sansio",
                ws_ping_interval=config.ws_ping_interval_s,
                ws_ping_timeout=config.ws_ping_interval_s,
            )
        )
        http.install_signal_handlers = lambda: None  # serve_until_signal owns SIGTERM
        http_task = asyncio.create_task(http.serve())

        async def expire() -> None:
            while True:
                await asyncio.sleep(min(30.0, config.session_idle_s / 2))
                if n := await sessions.expire_idle():
                    log.info("closed %d idle episode(s)", n)

        expiry = asyncio.create_task(expire())
        log.info(
            "environment provider %r: gRPC on %s:%d, HTTP on %s:%d",
            sessions.name,
            config.host,
            server.bound_port,
            config.host,
            config.http_port,
        )

        async def cleanup() -> None:
            expiry.cancel()
            http.should_exit = True
            await asyncio.wait([http_task], timeout=5)
            await sessions.close_all()

        return server, cleanup

    serve_until_signal(start)
