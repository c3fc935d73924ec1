"""An HTTP app served by uvicorn inside ``serve_until_signal`` (the gateway, the Tinker API)."""

from __future__ import annotations

import asyncio

from services.auth import AuthConfig
from services.http_limits import uvicorn_config


class UvicornServing:
    """A started uvicorn server; ``serve_until_signal`` stops it with ``stop(grace)``."""

    def __init__(self, server, task: asyncio.Task) -> None:
        self.server, self.task = server, task

    async def stop(self, grace: float) -> None:
        self.server.should_exit = True
        await asyncio.wait([self.task], timeout=grace)


def start_uvicorn(app, host: str, port: int, auth: AuthConfig) -> UvicornServing:
    """Serve ``app`` on ``host:port`` (TLS with ``auth.tls``) in this event loop; SIGTERM is
    ``serve_until_signal``'s, not uvicorn's."""
    import uvicorn

    config = uvicorn_config(app, host, port, auth)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None
    return UvicornServing(server, asyncio.create_task(server.serve()))
