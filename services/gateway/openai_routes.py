"""The gateway's OpenAI routes: ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``, also
under ``/sessions/{id}/v1/...`` (or with the ``x-rollmesh-session`` header) to address a session.

A chat request is bounded (messages, tokens, n), its images measured, its prompt rendered off the
event loop and bounded, then generated through the agent sessions (``rollout/agent/sessions.py``):
a session's turns are recorded for training, a request outside any session is only served.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from rollout.agent.render import ImageError
from rollout.agent.sessions import AgentSessions, Session, SessionError
from rollout.sampling import SamplingParams
from sample_buffer.errors import TransientError
from services.gateway.config import GatewayConfig
from services.gateway.openai_api import ChatRequest, CompletionRequest, chat_answer, completion_answer, measure_images
from services.gateway.streaming import chat_stream, completion_stream

SESSION_HEADER = "x-rollmesh-session"


class OpenAIRoutes:
    def __init__(self, sessions: AgentSessions, config: GatewayConfig) -> None:
        self.sessions, self.config = sessions, config
        self.tokenizer = sessions.renderer.tokenizer
        self.started = time.time()  # a Unix time: /v1/models answers it as OpenAI's "created"

    def router(self) -> APIRouter:
        router = APIRouter()
        for prefix in ("", "/sessions/{session_id}"):
            router.add_api_route(prefix + "/v1/models", self.models, methods=["GET"])
            router.add_api_route(prefix + "/v1/chat/completions", self.chat_completions, methods=["POST"])
            router.add_api_route(prefix + "/v1/completions", self.completions, methods=["POST"])
        return router

    def session_of(self, request: Request, session_id: str | None) -> Session | None:
        session_id = session_id or request.headers.get(SESSION_HEADER)
        return None if not session_id else self.sessions.get(session_id, request.state.owner)

    async def sampling(self, req, n: int) -> list[SamplingParams]:
        wanted = req.requested_tokens() or self.config.default_max_tokens
        if wanted > self.config.max_completion_tokens:
            raise SessionError(
                f"max_tokens: {wanted} is over the gateway's {self.config.max_completion_tokens}", "max_tokens"
            )
        if n > self.config.max_n:
            raise SessionError(f"n: {n} is over the gateway's {self.config.max_n}", "n")
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

    def check_prompt(self, prepared) -> None:
        if len(prepared.input_ids) > self.config.max_prompt_tokens:
            raise SessionError(
                f"messages: the prompt is {len(prepared.input_ids)} tokens, over the gateway's "
                f"{self.config.max_prompt_tokens}",
                "messages",
            )

    async def generate(self, session, messages, tools, prepared, params, stops, top_k, on_tokens=None):
        try:
            result = await self.sessions.chat(session, messages, tools, prepared, params, stops, top_k, on_tokens)
        except TransientError as e:
            raise SessionError(
                f"the policy is not reachable now ({e}); retry", status=503, code="unavailable"
            ) from None
        except TimeoutError:
            raise SessionError("the generation did not finish in time", status=504, code="timeout") from None
        except ValueError as e:  # the engine refused the request (too long for its context, ...)
            raise SessionError(str(e)) from None
        return result

    async def models(self, request: Request):
        return {
            "object": "list",
            "data": [
                {"id": self.config.model_name, "object": "model", "created": int(self.started), "owned_by": "rollmesh"}
            ],
        }

    async def chat_completions(self, request: Request, body: ChatRequest, session_id: str | None = None):
        session = self.session_of(request, session_id)
        if len(body.messages) > self.config.max_messages:
            raise SessionError(
                f"messages: {len(body.messages)} is over the gateway's {self.config.max_messages}", "messages"
            )
        params = await self.sampling(body, body.n)
        vision = self.sessions.renderer.vision
        urls = body.image_urls(vision)
        images = await asyncio.to_thread(measure_images, vision, urls) if urls else []
        messages = body.rendered_messages(vision.placeholder if vision else "", images)
        tools = body.template_tools()
        try:  # rendered off the event loop: a long prompt tokenizes for seconds (the tokenizer lets go of the GIL)
            prepared = await asyncio.to_thread(self.sessions.prepare, session, messages, tools)
        except SessionError:
            raise
        except ImageError as e:  # a placeholder written in the text: the images no longer match
            raise SessionError(str(e), "messages") from None
        except Exception as e:  # the template refused the conversation (a role it does not have, ...)
            raise SessionError(f"messages: the chat template cannot render them: {e}", "messages") from None
        self.check_prompt(prepared)
        args = (session, messages, tools, prepared, params, body.stops(), body.top_k())
        if body.stream:
            events = await chat_stream(
                body,
                lambda on_tokens: self.generate(*args, on_tokens),
                self.config.model_name,
                self.tokenizer,
                body.stops(),
                bool(tools),
            )
            return StreamingResponse(events, media_type="text/event-stream")
        result = await self.generate(*args)
        return chat_answer(
            body, result, self.config.model_name, self.tokenizer, session.session_id if session else None
        )

    async def completions(self, request: Request, body: CompletionRequest, session_id: str | None = None):
        session = self.session_of(request, session_id)
        params = await self.sampling(body, body.n)
        prepared = await asyncio.to_thread(self.sessions.prepare_text, session, body.prompt)
        self.check_prompt(prepared)
        args = (session, None, None, prepared, params, body.stops(), body.top_k())
        if body.stream:
            events = await completion_stream(
                body,
                lambda on_tokens: self.generate(*args, on_tokens),
                self.config.model_name,
                self.tokenizer,
                body.stops(),
            )
            return StreamingResponse(events, media_type="text/event-stream")
        result = await self.generate(*args)
        return completion_answer(
            body, result, self.config.model_name, self.tokenizer, session.session_id if session else None
        )
