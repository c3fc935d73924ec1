"""What every HTTP server rollmesh starts (the engine's, the gateway, the Tinker API, environment
providers) allows a connection before any credential is read.

uvicorn closes an idle keep-alive connection, but not one that never finishes its request's header:
300 connections each sending half a header, and one sending nothing, all stayed open 40 s and more,
each a file descriptor, from anyone who can reach the port. So a request's header must be complete
within ``HEADER_TIMEOUT_S`` of the connection (or of the previous response), and a server holds at
most ``MAX_CONNECTIONS`` connections: one past it is closed as it is accepted.
"""

from __future__ import annotations

import logging

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.auth import AuthConfig

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0  # from the connection (or the last response) to a whole request header
MAX_CONNECTIONS = 1024  # open at once per server; descriptors are the resource at stake
KEEP_ALIVE_S = 5.0  # uvicorn's own default, kept explicit: an idle connection after a response
# A stopping server waits this long for requests in flight (uvicorn's default waits for ever: one
# stuck handler would keep the process up past its supervisor's stop).
GRACEFUL_SHUTDOWN_S = 10.0


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a deadline on each request's header and a cap on connections."""

    header_timeout_s = HEADER_TIMEOUT_S
    max_connections = MAX_CONNECTIONS

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = None
        if len(self.connections) > self.max_connections:
            log.warning("%d connections open: one more refused", len(self.connections) - 1)
            transport.close()
            return
        self._await_head()

    def _await_head(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_too_slow)

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _stop_waiting(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def on_headers_complete(self) -> None:
        self._stop_waiting()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:  # the next request's header, on its clock
            self._await_head()

    def connection_lost(self, exc) -> None:
        self._stop_waiting()
        super().connection_lost(exc)


def uvicorn_config(app, host: str, port: int, auth: AuthConfig, **kw) -> uvicorn.Config:
    """A uvicorn config for ``app`` with TLS as ``auth`` says and the limits above."""
    tls = auth.tls
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        ssl_certfile=tls.cert_path if tls else None,
        ssl_keyfile=tls.key_path if tls else None,
        http=GuardedHttp,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **kw,
    )
