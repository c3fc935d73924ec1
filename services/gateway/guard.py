"""What the gateway checks before a request is read: the caller's key (each key is an owner), the
body's declared size, and the requests one key may have in flight. A request is in flight until
its answer's last byte is sent; a streamed answer too."""

from __future__ import annotations

from collections import Counter

from fastapi import Request

from services.gateway.config import GatewayConfig
from services.gateway.keys import KeyRing
from services.gateway.openai_api import error


class Guard:
    """The gateway's first middleware. ``keys`` None: no key is asked for (every caller is
    ``anonymous``). It counts requests by route and status class for the metrics."""

    def __init__(self, config: GatewayConfig, keys: KeyRing | None) -> None:
        self.config, self.keys = config, keys
        self.in_flight: Counter[str] = Counter()
        self.counts: Counter[tuple[str, str]] = Counter()  # (route, status class)

    async def __call__(self, request: Request, call_next):
        if request.url.path in ("/health", "/metrics"):
            return await call_next(request)
        owner = "anonymous" if self.keys is None else self.keys.owner(request.headers.get("authorization"))
        if owner is None:
            self.counts[("auth", "4xx")] += 1
            return error(
                401,
                "authorization: a valid API key is required (Authorization: Bearer KEY)",
                "authorization",
                "invalid_api_key",
            )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.config.max_request_bytes:
            return error(413, f"body: {length} bytes is over the gateway's {self.config.max_request_bytes}", "body")
        if self.in_flight[owner] >= self.config.max_concurrent_requests:
            self.counts[("limit", "4xx")] += 1
            return error(
                429,
                f"too many requests in flight for this key (max {self.config.max_concurrent_requests})",
                code="rate_limit_exceeded",
            )
        request.state.owner = owner
        self.in_flight[owner] += 1
        try:
            response = await call_next(request)
        except BaseException:
            self.in_flight[owner] -= 1
            raise
        self.counts[(_route(request.url.path), f"{response.status_code // 100}xx")] += 1
        # In flight until its body is sent: a streamed answer's response starts with its first token,
        # and counting it done then let any number of streams of one key generate at once.
        response.body_iterator = _released(response.body_iterator, lambda: self.in_flight.subtract([owner]))
        return response


async def _released(body, release):
    """``body``'s chunks, then ``release()``: once, at its end, on an error, or when the client goes."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        release()


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
