"""What every engine client shares: one aiohttp session, timeouts, and errors split by what the
caller should do: ``EngineRejected`` (HTTP 4xx: the request is bad, do not retry) and
``EngineUnavailable`` (connection refused, timeout, 5xx, an answer that is not JSON: try another
engine). ``SGLangClient`` and ``VLLMClient`` speak their engines' APIs on top of it and return the
same ``EngineResult``, so the LLMProxy does not know which engine it drives.

It uses aiohttp rather than httpx: with hundreds of concurrent requests httpx's connection pool
costs ~9 ms of CPU per request on this project's 2-core machines, aiohttp ~0.5 ms.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from sample_buffer.trajectory import FinishReason


class EngineRejected(ValueError):
    """The engine answered 4xx: the request itself is wrong. ``field`` names the input when known."""

    def __init__(self, message: str, field: str = "", status: int = 400) -> None:
        super().__init__(message)
        self.field, self.status = field, status


class EngineUnavailable(ConnectionError):
    """The engine did not answer in time or failed: the request may succeed elsewhere."""


@dataclass
class EngineResult:
    output_ids: list[int]
    behavior_logprobs: list[float]
    token_versions: list[int]
    finish_reason: FinishReason
    weight_version: int
    prompt_tokens: int
    e2e_latency_s: float
    queue_time_s: float | None = None  # rollmesh engines report these; a stock SGLang server may not
    ttft_s: float | None = None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, when asked: (id, lp)
    # MoE, when asked: [positions, layers × top_k] expert ids (``sample_buffer/routing.py``), its first row
    # position ``routed_experts_start``
    routed_experts: np.ndarray | None = None
    routed_experts_start: int = 0


@dataclass
class ScoreResult:
    """A scoring call's answer: the log-prob of each given token from the start on (temperature 1),
    and the weight version that scored them; when asked, each position's most likely tokens."""

    logprobs: list[float]
    weight_version: int
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: (id, lp), best first


OnTokens = Callable[[list[int]], None]  # a streamed generation's new tokens, as they arrive


def int_version(v) -> int:
    """An engine's weight-version label as a run's version. SGLang's and vLLM's label before any
    update is "default": the checkpoint the engine started from, version 0 of a run. A missing or
    unreadable label is -1, which no run's version equals."""
    if v == "default":
        return 0
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def _error(body, text: str) -> tuple[str, str]:
    """(message, field) of a 4xx answer: rollmesh's and SGLang's ``{message, field}``, vLLM's
    ``{error: {message, param}}``, FastAPI's ``{detail}``, or the raw text."""
    if not isinstance(body, dict):
        return text, ""
    err = body.get("error")
    if isinstance(err, dict):
        return str(err.get("message", text)), str(err.get("param") or "")
    if "detail" in body and "message" not in body:
        return str(body["detail"]), ""
    return str(body.get("message", text)), str(body.get("field", ""))


# SGLang's, vLLM's and the embedded engine's servers all run on uvicorn, which closes a keep-alive connection
# idle for 5 s; aiohttp would keep it pooled for 15 s and could reuse a socket the server has just
# closed ("Server disconnected", "Can not write request body"), which takes a healthy engine out of
# rotation. Dropping idle connections first closes that race.
KEEPALIVE_S = 4.0


class HTTPEngineClient:
    """One engine server over HTTP. Every call has a timeout; none retries (the proxy decides that)."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 60.0,
        max_connections: int = 0,
        headers: dict[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """``headers`` go with every request (``Authorization: Bearer ...``: SGLang's ``--api-key``
        and rollmesh engines check it); ``ssl_context``: the one that trusts an https engine."""
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._max_connections = max_connections  # 0 = unbounded
        self._headers = headers or {}
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        # Created on first use, inside the event loop that will run the requests.
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, keepalive_timeout=KEEPALIVE_S, ssl=self._ssl or True
            )
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _request(
        self,
        method: str,
        path: str,
        timeout_s: float | None,
        session: aiohttp.ClientSession | None = None,
        plain: bool = False,
        listed: bool = False,
        **kwargs,
    ) -> dict:
        """The JSON object the engine answers; ``plain``: a 2xx answer in plain text is ``{"message": text}``
        (vLLM's adapter routes answer so); ``listed``: a JSON list of objects (a batch's answers)."""
        url = self.base_url + path
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with (session or self._http()).request(method, url, timeout=timeout, **kwargs) as r:
                text = await r.text()
                status = r.status
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise EngineUnavailable(f"{url}: {type(e).__name__}: {e}") from e
        if 400 <= status < 500:
            try:
                body = json.loads(text)
            except ValueError:
                body = {}
            raise EngineRejected(*_error(body, text), status)
        if status >= 500:
            raise EngineUnavailable(f"{url}: HTTP {status}: {text[:200]}")
        if not text.strip():
            return {}  # SGLang's /health and /abort_request: 200, no body
        if plain:
            return {"message": text}
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        if listed and isinstance(body, list) and all(isinstance(b, dict) for b in body):
            return body
        if not isinstance(body, dict):  # not an engine we can speak with: take it out of rotation
            what = "a list of JSON objects" if listed else "a JSON object"
            raise EngineUnavailable(f"{url}: HTTP {status} with a body that is not {what}: {text[:200]!r}")
        return body

    async def _post_events(self, path: str, timeout_s: float | None, **kwargs) -> AsyncIterator[dict]:
        """A POST answered with server-sent events: each ``data:`` JSON object as it arrives, up
        to ``[DONE]``. The timeout covers the whole stream; errors split as in ``_request``."""
        url = self.base_url + path
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self._http().post(url, timeout=timeout, **kwargs) as r:
                if r.status >= 400:
                    text = await r.text()
                    if r.status >= 500:
                        raise EngineUnavailable(f"{url}: HTTP {r.status}: {text[:200]}")
                    try:
                        body = json.loads(text)
                    except ValueError:
                        body = {}
                    raise EngineRejected(*_error(body, text), r.status)
                pending = b""
                # Lines split here: aiohttp's own line reader refuses a line over 64 KiB, and
                # SGLang's events carry every token so far.
                async for chunk in r.content.iter_any():
                    *lines, pending = (pending + chunk).split(b"\n")
                    for raw in lines:
                        line = raw.decode().strip()
                        if not line.startswith("data:"):
                            continue  # blank separators, comments, event names
                        data = line[len("data:") :].strip()
                        if data == "[DONE]":
                            return
                        try:
                            event = json.loads(data)
                        except ValueError as e:
                            raise EngineUnavailable(f"{url}: an event that is not JSON: {data[:200]!r}") from e
                        if not isinstance(event, dict):
                            raise EngineUnavailable(f"{url}: an event that is not a JSON object: {data[:200]!r}")
                        yield event
                raise EngineUnavailable(f"{url}: the stream ended without [DONE]")
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise EngineUnavailable(f"{url}: {type(e).__name__}: {e}") from e

    async def _post(self, path: str, timeout_s: float | None = None, **kwargs) -> dict:
        return await self._request("POST", path, timeout_s, **kwargs)

    async def _post_alone(self, path: str, timeout_s: float | None = None, **kwargs) -> dict:
        """A POST on a connection of its own, closed after it: for calls a server may answer and
        then drop the connection after (vLLM after a failed ``/collective_rpc``: the next request
        on that pooled socket is reset), or that write hundreds of MB into a socket the server may
        have closed while the caller's loop was busy (a weight bucket). One connect costs nothing
        next to either."""
        connector = aiohttp.TCPConnector(force_close=True, ssl=self._ssl or True)
        async with aiohttp.ClientSession(connector=connector, headers=self._headers) as session:
            return await self._request("POST", path, timeout_s, session=session, **kwargs)

    async def _get(self, path: str, timeout_s: float | None = None) -> dict:
        return await self._request("GET", path, timeout_s)

    async def health(self, timeout_s: float = 2.0) -> bool:
        try:
            await self._get("/health", timeout_s)
            return True
        except (EngineUnavailable, EngineRejected):
            return False
