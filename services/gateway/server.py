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
import time
from collections import Counter

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.agent.render import ImageError
from rollout.agent.sessions import AgentSessions, Session, SessionError
from rollout.sampling import SamplingParams
from sample_buffer.errors import TransientError
from services.body_limit import BodyLimit
from services.gateway.config import GatewayConfig
from services.gateway.keys import KeyRing
from services.gateway.openai_api import (
    ChatRequest,
    CompletionRequest,
    EndRequest,
    RewardRequest,
    SessionRequest,
    chat_answer,
    completion_answer,
    error,
    measure_images,
)
from services.gateway.streaming import chat_stream, completion_stream
from services.http_errors import field_name

log = logging.getLogger(__name__)
SESSION_HEADER = "x-rollmesh-session"


async def _released(body, release):
    """``body``'s chunks, then ``release()``: once, at its end, on an error, or when the client goes."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        release()


def create_app(sessions: AgentSessions, config: GatewayConfig, keys: KeyRing | None) -> FastAPI:
    """``keys`` None: no key is asked for (``auth.disabled``; every caller is ``anonymous``)."""
    app = FastAPI(title="rollmesh agent gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)  # chunked bodies too
    tokenizer = sessions.renderer.tokenizer
    in_flight: Counter[str] = Counter()
    counts: Counter[tuple[str, str]] = Counter()  # (route, status class)
    started = time.time()  # a Unix time: /v1/models answers it as OpenAI's "created"

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        field = field_name(tuple(err.get("loc", ())))
        if err.get("type") == "json_invalid":
            return error(400, "body: malformed JSON", "body")
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        return error(400, f"{field}: {message}", field)

    @app.exception_handler(SessionError)
    async def _refused(_: Request, exc: SessionError) -> JSONResponse:
        return error(exc.status, str(exc), exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:  # unknown route, wrong method
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI's: a body that is not even UTF-8
            return error(400, f"body: malformed JSON ({exc.__cause__})", "body")
        if exc.status_code == 413:  # BodyLimit's detail names the body
            return error(413, str(exc.detail), "body")
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:  # still OpenAI's shape, and logged
        log.exception("unexpected error")
        return error(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if request.url.path in ("/health", "/metrics"):
            return await call_next(request)
        owner = "anonymous" if keys is None else keys.owner(request.headers.get("authorization"))
        if owner is None:
            counts[("auth", "4xx")] += 1
            return error(
                401,
                "authorization: a valid API key is required (Authorization: Bearer KEY)",
                "authorization",
                "invalid_api_key",
            )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_request_bytes:
            return error(413, f"body: {length} bytes is over the gateway's {config.max_request_bytes}", "body")
        if in_flight[owner] >= config.max_concurrent_requests:
            counts[("limit", "4xx")] += 1
            return error(
                429,
                f"too many requests in flight for this key (max {config.max_concurrent_requests})",
                code="rate_limit_exceeded",
            )
        request.state.owner = owner
        in_flight[owner] += 1
        try:
            response = await call_next(request)
        except BaseException:
            in_flight[owner] -= 1
            raise
        counts[(_route(request.url.path), f"{response.status_code // 100}xx")] += 1
        # In flight until its body is sent: a streamed answer's response starts with its first token,
        # and counting it done then let any number of streams of one key generate at once.
        response.body_iterator = _released(response.body_iterator, lambda: in_flight.subtract([owner]))
        return response

    def session_of(request: Request, session_id: str | None) -> Session | None:
        session_id = session_id or request.headers.get(SESSION_HEADER)
        return None if not session_id else sessions.get(session_id, request.state.owner)

    async def sampling(req, n: int) -> list[SamplingParams]:
        wanted = req.requested_tokens() or config.default_max_tokens
        if wanted > config.max_completion_tokens:
            raise SessionError(
                f"max_tokens: {wanted} is over the gateway's {config.max_completion_tokens}", "max_tokens"
            )
        if n > config.max_n:
            raise SessionError(f"n: {n} is over the gateway's {config.max_n}", "n")
        # a forced call's grammar is built by xgrammar (imported on first use, then cached): off the loop
        grammar = await asyncio.to_thread(req.grammar)
        return [
            SamplingParams(
                max_new_tokens=wanted,
                temperature=req.temperature,
                top_p=req.top_p,
                sampling_seed=None if req.seed is None else req.seed + i,
                **({} if grammar is None else {grammar[0]: grammar[1]}),
            )
            for i in range(n)
        ]

    def check_prompt(prepared) -> None:
        if len(prepared.input_ids) > config.max_prompt_tokens:
            raise SessionError(
                f"messages: the prompt is {len(prepared.input_ids)} tokens, over the gateway's "
                f"{config.max_prompt_tokens}",
                "messages",
            )

    async def generate(session, messages, tools, prepared, params, stops, top_k, on_tokens=None):
        try:
            result = await sessions.chat(session, messages, tools, prepared, params, stops, top_k, on_tokens)
        except TransientError as e:
            raise SessionError(
                f"the policy is not reachable now ({e}); retry", status=503, code="unavailable"
            ) from None
        except TimeoutError:
            raise SessionError("the generation did not finish in time", status=504, code="timeout") from None
        except ValueError as e:  # the engine refused the request (too long for its context, ...)
            raise SessionError(str(e)) from None
        return result

    # ------------------------------------------------------------------ OpenAI
    async def models(request: Request):
        return {
            "object": "list",
            "data": [{"id": config.model_name, "object": "model", "created": int(started), "owned_by": "rollmesh"}],
        }

    async def chat_completions(request: Request, body: ChatRequest, session_id: str | None = None):
        session = session_of(request, session_id)
        if len(body.messages) > config.max_messages:
            raise SessionError(
                f"messages: {len(body.messages)} is over the gateway's {config.max_messages}", "messages"
            )
        params = await sampling(body, body.n)
        vision = sessions.renderer.vision
        urls = body.image_urls(vision)
        images = await asyncio.to_thread(measure_images, vision, urls) if urls else []
        messages = body.rendered_messages(vision.placeholder if vision else "", images)
        tools = body.template_tools()
        try:  # rendered off the event loop: a long prompt tokenizes for seconds (the tokenizer lets go of the GIL)
            prepared = await asyncio.to_thread(sessions.prepare, session, messages, tools)
        except SessionError:
            raise
        except ImageError as e:  # a placeholder written in the text: the images no longer match
            raise SessionError(str(e), "messages") from None
        except Exception as e:  # the template refused the conversation (a role it does not have, ...)
            raise SessionError(f"messages: the chat template cannot render them: {e}", "messages") from None
        check_prompt(prepared)
        args = (session, messages, tools, prepared, params, body.stops(), body.top_k())
        if body.stream:
            events = await chat_stream(
                body,
                lambda on_tokens: generate(*args, on_tokens),
                config.model_name,
                tokenizer,
                body.stops(),
                bool(tools),
            )
            return StreamingResponse(events, media_type="text/event-stream")
        result = await generate(*args)
        return chat_answer(body, result, config.model_name, tokenizer, session.session_id if session else None)

    async def completions(request: Request, body: CompletionRequest, session_id: str | None = None):
        session = session_of(request, session_id)
        params = await sampling(body, body.n)
        prepared = await asyncio.to_thread(sessions.prepare_text, session, body.prompt)
        check_prompt(prepared)
        args = (session, None, None, prepared, params, body.stops(), body.top_k())
        if body.stream:
            events = await completion_stream(
                body, lambda on_tokens: generate(*args, on_tokens), config.model_name, tokenizer, body.stops()
            )
            return StreamingResponse(events, media_type="text/event-stream")
        result = await generate(*args)
        return completion_answer(body, result, config.model_name, tokenizer, session.session_id if session else None)

    for prefix in ("", "/sessions/{session_id}"):
        app.add_api_route(prefix + "/v1/models", models, methods=["GET"])
        app.add_api_route(prefix + "/v1/chat/completions", chat_completions, methods=["POST"])
        app.add_api_route(prefix + "/v1/completions", completions, methods=["POST"])

    # ------------------------------------------------------------------ sessions
    @app.post("/v1/sessions")
    async def create_session(request: Request, body: SessionRequest | None = None):
        body = body or SessionRequest()
        session = await sessions.create(request.state.owner, body.group, body.group_size)
        return {
            "id": session.session_id,
            "group": session.group.group_id,
            "group_size": session.group.size,
            "base_url": f"{str(request.base_url).rstrip('/')}/sessions/{session.session_id}/v1",
        }

    @app.get("/v1/sessions/{session_id}")
    async def describe_session(request: Request, session_id: str):
        s = sessions.get(session_id, request.state.owner)
        return {
            "id": s.session_id,
            "group": s.group.group_id,
            "requests": s.requests,
            "reward": s.reward,
            "ended": s.ended,
            "branches": len(s.tree.tips()),
            "forks": s.tree.forks,
        }

    @app.post("/v1/sessions/{session_id}/reward")
    async def reward_session(request: Request, session_id: str, body: RewardRequest):
        sessions.set_reward(sessions.get(session_id, request.state.owner), body.reward)
        return {"id": session_id, "reward": body.reward}

    @app.post("/v1/sessions/{session_id}/end")
    async def end_session(request: Request, session_id: str, body: EndRequest | None = None):
        session = sessions.get(session_id, request.state.owner)
        try:
            group = await sessions.end(session, (body or EndRequest()).reward)
        except TransientError as e:
            raise SessionError(f"the SampleBuffer is not reachable now ({e})", status=503, code="unavailable") from None
        return {"id": session_id, "ended": True, "group": session.group.group_id, "group_state": group}

    # ------------------------------------------------------------------ health and metrics
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    registry = CollectorRegistry()
    registry.register(_Collector(sessions, counts, in_flight))

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _route(path: str) -> str:
    """A metric label for a path: one per route, never a session id."""
    for suffix, name in (
        ("/chat/completions", "chat"),
        ("/completions", "completions"),
        ("/models", "models"),
        ("/reward", "reward"),
        ("/end", "end"),
        ("/v1/sessions", "create"),
    ):
        if path.endswith(suffix):
            return name
    return "session" if path.startswith("/v1/sessions/") else "other"


class _Collector:
    def __init__(self, sessions: AgentSessions, counts: Counter, in_flight: Counter) -> None:
        self.sessions, self.counts, self.in_flight = sessions, counts, in_flight

    def collect(self):
        c = self.sessions.counters
        events = CounterMetricFamily("rollmesh_gateway_events", "Sessions and groups by event", labels=["event"])
        for name in (
            "sessions_created",
            "sessions_ended",
            "groups_put",
            "groups_filtered",
            "groups_failed",
            "groups_empty",
            "groups_abandoned",
            "admit_refused",
            "trajectories_put",
        ):
            events.add_metric([name], c[name])
        yield events
        tokens = CounterMetricFamily("rollmesh_gateway_prompt_tokens", "Prompt tokens by origin", labels=["origin"])
        tokens.add_metric(["rendered"], c["tokens_rendered"])
        tokens.add_metric(["reused"], c["tokens_reused"])
        yield tokens
        requests = CounterMetricFamily(
            "rollmesh_gateway_requests", "Requests by route and status", labels=["route", "status"]
        )
        for (route, status), n in self.counts.items():
            requests.add_metric([route, status], n)
        yield requests
        live = GaugeMetricFamily("rollmesh_gateway_sessions_open", "Sessions not yet ended")
        live.add_metric([], sum(not s.ended for s in self.sessions.sessions.values()))
        yield live
        flight = GaugeMetricFamily("rollmesh_gateway_requests_in_flight", "Requests being served")
        flight.add_metric([], sum(self.in_flight.values()))
        yield flight


async def expire_forever(sessions: AgentSessions, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        if n := await sessions.expire_idle():
            log.info("abandoned %d group(s) with an idle session", n)
