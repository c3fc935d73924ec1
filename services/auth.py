"""Who may call a rollmesh service: a shared bearer token on every gRPC call and HTTP request, TLS optional.

The token comes from ``auth.token`` or the ``ROLLMESH_TOKEN`` environment variable. `rollmesh run`
makes a fresh one per run and hands it to its processes through the environment (a command line
would show it in ``ps``); a cluster mounts it from a Secret. A service refuses to start without
one unless ``auth.disabled`` says the network is closed to everyone else.

Not checked: health checks (gRPC ``grpc.health.v1.Health``, HTTP ``/health``) and ``/metrics``.
Kubernetes probes and Prometheus scrapes carry no secret, and these answer with liveness and
counts only, never prompts, tokens or weights.

A refused call gets ``UNAUTHENTICATED`` / HTTP 401 and is counted in
``rollmesh_auth_refused_requests_total{reason="missing"|"wrong"}`` on the service's ``/metrics``.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import ssl
from collections import Counter
from pathlib import Path

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

log = logging.getLogger(__name__)
TOKEN_ENV = "ROLLMESH_TOKEN"
# Set by an engine process started with auth disabled: the vLLM plugin otherwise refuses to serve
# without a token (an empty one must not mean "open").
AUTH_DISABLED_ENV = "ROLLMESH_AUTH_DISABLED"
EXEMPT_GRPC_PREFIX = "/grpc.health.v1.Health/"
EXEMPT_HTTP_PATHS = frozenset({"/health", "/metrics"})


class AuthError(RuntimeError):
    """No token where one is required: the process cannot serve or call safely."""


class TlsConfig(BaseModel):
    """Certificates in PEM files. A server needs ``cert_path`` and ``key_path``; a client needs
    ``ca_path`` unless the servers' certificates chain to the system's roots."""

    model_config = ConfigDict(extra="forbid")

    cert_path: str | None = Field(None, description="This service's certificate chain (PEM).")
    key_path: str | None = Field(None, description="The private key of cert_path (PEM).")
    ca_path: str | None = Field(
        None, description="The CA certificate clients trust (for a self-signed certificate: the certificate itself)."
    )

    @model_validator(mode="after")
    def _files_exist(self) -> TlsConfig:
        for name in ("cert_path", "key_path", "ca_path"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no file {path}")
        if (self.cert_path is None) != (self.key_path is None):
            raise ValueError("cert_path and key_path: give both or neither")
        return self

    def read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        return Path(path).read_bytes() if path else None


def _token_from_env() -> SecretStr | None:
    value = os.environ.get(TOKEN_ENV)
    return SecretStr(value) if value else None


class AuthConfig(BaseModel):
    """The run's shared secret and transport security; every service and client of a mesh reads
    the same section."""

    model_config = ConfigDict(extra="forbid")

    token: SecretStr | None = Field(
        default_factory=_token_from_env,
        description=f"The bearer token every call must carry; default: ${TOKEN_ENV}. `rollmesh run` makes one per run.",
    )
    disabled: bool = Field(
        False, description="Serve and call without a token: only on a network nobody else can reach."
    )
    tls: TlsConfig | None = Field(None, description="TLS for gRPC and HTTP (certificate paths); none: plaintext.")

    def bearer(self) -> str | None:
        """``Bearer <token>``, or None when auth is disabled; ``AuthError`` when no token is set."""
        if self.disabled:
            return None
        if self.token is None or not self.token.get_secret_value():
            raise AuthError(
                f"auth.token: no token; set {TOKEN_ENV} (every service and client of the mesh the same) "
                "or auth.token, or auth.disabled: true on a closed network"
            )
        return "Bearer " + self.token.get_secret_value()

    @property
    def scheme(self) -> str:
        """``https`` or ``http``: how the engines' HTTP API is reached."""
        return "https" if self.tls else "http"

    def client_ssl(self) -> ssl.SSLContext | None:
        """For HTTP clients (aiohttp, httpx): trust ``tls.ca_path``; None without TLS."""
        if self.tls is None:
            return None
        return ssl.create_default_context(cafile=self.tls.ca_path)


def ensure_token(auth: AuthConfig) -> AuthConfig:
    """Give ``auth`` a fresh random token if it has none (and is not disabled), exported through
    ``ROLLMESH_TOKEN`` so the processes this one starts share it."""
    if not auth.disabled and auth.token is None:
        token = secrets.token_urlsafe(32)
        os.environ[TOKEN_ENV] = token
        auth.token = SecretStr(token)
    return auth


def server_bearer(auth: AuthConfig, server: str) -> str | None:
    """The bearer a server checks. With ``auth.disabled``: None, a warning in the log, and
    ``rollmesh_auth_disabled 1`` on the process's /metrics, so an open service is never a quiet one."""
    bearer = auth.bearer()
    if bearer is None:
        SERVING_OPEN.add(server)
        log.warning("%s: auth.disabled: serving WITHOUT a token; anyone who reaches its port may call it", server)
    return bearer


# ---------------------------------------------------------------- refused calls, per process
REFUSED: Counter[str] = Counter({"missing": 0, "wrong": 0})
SERVING_OPEN: set[str] = set()  # this process's servers that check no token (auth.disabled)


class RefusedCollector:
    """``rollmesh_auth_refused_requests_total{reason}`` and ``rollmesh_auth_disabled`` for a
    service's registry."""

    def collect(self):
        yield GaugeMetricFamily(
            "rollmesh_auth_disabled", "1: this process serves without a token (auth.disabled)", value=bool(SERVING_OPEN)
        )
        family = CounterMetricFamily(
            "rollmesh_auth_refused_requests", "Calls refused for a missing or wrong bearer token", labels=["reason"]
        )
        for reason, n in sorted(REFUSED.items()):
            family.add_metric([reason], n)
        yield family


def _refusal(got: bytes | str | None, expected: str) -> str | None:
    """None when ``got`` is the expected header; else why not ("missing" or "wrong"), counted."""
    if got is not None:
        got = got.encode() if isinstance(got, str) else got
        if hmac.compare_digest(got, expected.encode()):
            return None
    reason = "missing" if got is None else "wrong"
    REFUSED[reason] += 1
    return reason


def _message(reason: str) -> str:
    return f"authorization: {reason} bearer token (send 'authorization: Bearer <token>', the run's {TOKEN_ENV})"


# ---------------------------------------------------------------- gRPC
class TokenCheck(grpc.aio.ServerInterceptor):
    """Server side: every RPC but health checks carries ``authorization: Bearer <token>``."""

    def __init__(self, bearer: str) -> None:
        self.bearer = bearer

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_GRPC_PREFIX):
            return handler
        got = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        reason = _refusal(got, self.bearer)
        if reason is None:
            return handler

        async def refuse(requests, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _message(reason))

        # A streaming-request handler that never reads: the refused call's message is not received (a
        # unary handler gets the whole message before it runs, up to the server's receive limit: one
        # 200 MiB call without a token took the buffer to 700 MB). HTTP/2 flow control stops the
        # sender after a window's worth; the stream is reset with the status.
        make = grpc.stream_stream_rpc_method_handler if handler.unary_stream else grpc.stream_unary_rpc_method_handler
        return make(refuse, request_deserializer=None, response_serializer=handler.response_serializer)


class _AddToken:
    """Client side: the token goes with every call of the channel."""

    def __init__(self, bearer: str) -> None:
        self.pair = ("authorization", bearer)

    def _details(self, d):
        return d._replace(metadata=grpc.aio.Metadata(*(d.metadata or ()), self.pair))


# grpc.aio files an interceptor under the first call kind it implements: one class per kind.
class _AddTokenUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AddTokenStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


def grpc_server_credentials(auth: AuthConfig) -> grpc.ServerCredentials | None:
    if auth.tls is None:
        return None
    if auth.tls.cert_path is None:
        raise AuthError("auth.tls.cert_path: a TLS server needs its certificate and key")
    return grpc.ssl_server_credentials([(auth.tls.read("key_path"), auth.tls.read("cert_path"))])


def grpc_server_interceptors(auth: AuthConfig, server: str = "gRPC server") -> list[grpc.aio.ServerInterceptor]:
    bearer = server_bearer(auth, server)
    return [TokenCheck(bearer)] if bearer else []


def grpc_channel(address: str, auth: AuthConfig, options: list) -> grpc.aio.Channel:
    """An aio channel that carries the token (and speaks TLS when configured)."""
    bearer = auth.bearer()
    interceptors = [_AddTokenUnary(bearer), _AddTokenStream(bearer)] if bearer else None
    if auth.tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    creds = grpc.ssl_channel_credentials(root_certificates=auth.tls.read("ca_path"))
    return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)


def grpc_sync_channel(address: str, auth: AuthConfig, options: list | None = None) -> grpc.Channel:
    """A blocking channel (TLS when configured). It adds no token: health checks need none, and a
    blocking caller passes ``auth.bearer()`` as the call's ``authorization`` metadata."""
    if auth.tls is None:
        return grpc.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(root_certificates=auth.tls.read("ca_path"))
    return grpc.secure_channel(address, creds, options=options)


# ---------------------------------------------------------------- HTTP
class BearerMiddleware:
    """ASGI middleware: 401 for a request without the token (health and metrics excepted), a
    refused handshake for a WebSocket without it. Plain
    ASGI rather than Starlette's BaseHTTPMiddleware, which costs a task per request."""

    def __init__(self, app, bearer: str) -> None:
        self.app, self.bearer = app, bearer

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and scope["path"] not in EXEMPT_HTTP_PATHS:
            got = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            reason = _refusal(got, self.bearer)
            if reason is not None and scope["type"] == "websocket":  # refused at the handshake (HTTP 403)
                await send({"type": "websocket.close", "code": 1008, "reason": _message(reason)[:120]})
                return
            if reason is not None:
                body = json.dumps(
                    {"object": "error", "code": 401, "field": "authorization", "message": _message(reason)}
                ).encode()
                headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def http_headers(auth: AuthConfig) -> dict[str, str]:
    """Headers an HTTP client sends to an engine."""
    bearer = auth.bearer()
    return {"Authorization": bearer} if bearer else {}
