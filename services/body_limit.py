"""ASGI middleware: a request body over its limit gets HTTP 413, counted as it arrives.

Checking ``Content-Length`` alone let a chunked body (no length) of 40 MiB be read in full by the
gateway. Here every ``http.request`` message is counted before the app sees it: a declared length
over the limit is refused before a byte is read, an undeclared one as soon as it passes the limit
(the app's read raises ``HTTPException(413)``, which its error handlers answer).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException


class BodyLimit:
    """``max_bytes`` for every route; ``routes``: path → a larger (or smaller) limit of its own."""

    def __init__(self, app, max_bytes: int, routes: dict[str, int] | None = None) -> None:
        self.app, self.max_bytes, self.routes = app, max_bytes, routes or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.routes.get(scope["path"], self.max_bytes)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self.app(scope, _refuse(f"body: {int(declared)} bytes is over this route's {limit}"), send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, f"body: over this route's {limit} bytes (read {received} so far)")
            return message

        await self.app(scope, counted, send)


def _refuse(detail: str):
    async def receive():
        raise HTTPException(413, detail)

    return receive
