"""Streamed answers (``stream: true``): OpenAI's SSE chunks sent as the engine makes the tokens.

The generation runs as a task that hands each choice's new tokens over (the LLMProxy's
``GenerateStream``); each becomes a content chunk as soon as its text is safe to send
(``rollout/agent/text_stream.py``). Once the answer is whole, each choice gets the text held
back, its log-probs when asked (in one chunk: they come with the finished generation), its tool
calls and its finish reason; then usage when asked, then ``[DONE]``. An error before the first
token is an ordinary HTTP error; after it, an ``error`` event ends the stream. A client that goes
away cancels the generation (the proxy aborts it at the engine).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from rollout.agent.sessions import ChatResult, SessionError
from rollout.agent.text_stream import TextStream
from services.gateway.openai_api import (
    ChatRequest,
    CompletionRequest,
    completion_finish,
    completion_logprobs,
    token_logprobs,
    usage,
)
from services.streams import until_done

log = logging.getLogger(__name__)
Run = Callable[[Callable[[int, list[int]], None]], Awaitable[ChatResult]]


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class _Pieces:
    """The generation task and the pieces of tokens it hands over, in order."""

    def __init__(self, run: Run) -> None:
        self.queue: asyncio.Queue[tuple[int, list[int]]] = asyncio.Queue()
        self.task = asyncio.ensure_future(run(lambda i, ids: self.queue.put_nowait((i, ids))))
        self._head: tuple[int, list[int]] | None = None

    async def started(self) -> None:
        """Wait for the first token or the end; an error before any token is raised here."""
        get = asyncio.ensure_future(self.queue.get())
        try:
            await asyncio.wait({get, self.task}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the client went away before the first token
            get.cancel()
            self.close()
            raise
        if get.done():
            self._head = get.result()
        else:
            get.cancel()
            self.task.result()

    async def __aiter__(self) -> AsyncIterator[tuple[int, list[int]]]:
        if self._head is not None:
            yield self._head
        async for piece in until_done(self.queue, self.task):
            yield piece

    def close(self) -> None:
        if not self.task.done():  # the client went away: the generation stops
            self.task.cancel()


async def _events(pieces: _Pieces, n: int, tokenizer, stop: list[str], tools: bool, start, delta, end):
    """The stream's events: ``start(i)`` once per choice, ``delta(i, text)`` as text is safe,
    ``end(result)`` once the answer is whole (its events), or an error event."""
    streams = [TextStream(tokenizer, stop, tools) for _ in range(n)]
    try:
        for i in range(n):
            if (first := start(i)) is not None:
                yield first
        async for i, ids in pieces:
            if text := streams[i].push(ids):
                yield delta(i, text)
        try:
            result = pieces.task.result()
        except Exception as e:  # the status line is sent: the error is an event (OpenAI's shape)
            param, code = (e.param, e.code) if isinstance(e, SessionError) else (None, None)
            if not isinstance(e, SessionError):
                log.exception("a streamed generation failed")
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": param, "code": code}})
            yield _sse("[DONE]")
            return
        for event in end(result, streams):
            yield event
        yield _sse("[DONE]")
    finally:
        pieces.close()


async def chat_stream(req: ChatRequest, run: Run, model: str, tokenizer, stop: list[str], tools: bool):
    """Chat completion chunks; returns the async iterator of events once the first token is out."""
    pieces = _Pieces(run)
    await pieces.started()
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs=None) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return _sse(
            {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
        )

    def end(result: ChatResult, streams: list[TextStream]):
        for i, c in enumerate(result.choices):
            rest = streams[i].rest(c.message.get("content") or "")
            logprobs = {"content": token_logprobs(tokenizer, c)} if req.logprobs else None
            if rest or logprobs:
                yield chunk(i, {"content": rest}, logprobs=logprobs)
            for k, call in enumerate(c.message.get("tool_calls") or []):
                yield chunk(i, {"tool_calls": [{"index": k, **call}]})
            yield chunk(i, {}, c.finish_reason)
        if req.include_usage():
            yield _sse(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage(result),
                }
            )

    return _events(
        pieces,
        req.n,
        tokenizer,
        stop,
        tools,
        lambda i: chunk(i, {"role": "assistant", "content": ""}),
        lambda i, text: chunk(i, {"content": text}),
        end,
    )


async def completion_stream(req: CompletionRequest, run: Run, model: str, tokenizer, stop: list[str]):
    pieces = _Pieces(run)
    await pieces.started()
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(index: int, text: str, finish: str | None = None, logprobs=None) -> str:
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return _sse({"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [choice]})

    def end(result: ChatResult, streams: list[TextStream]):
        for i, c in enumerate(result.choices):
            logprobs = completion_logprobs(tokenizer, c, req.top_k()) if req.logprobs is not None else None
            yield chunk(i, streams[i].rest(c.text), completion_finish(c), logprobs)
        if req.include_usage():
            yield _sse(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage(result),
                }
            )

    return _events(pieces, req.n, tokenizer, stop, False, lambda i: None, chunk, end)
