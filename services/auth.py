"""Who may call a rollmesh service: a bearer token per role on every gRPC call and HTTP request, TLS optional.

Two roles (``Role``), two tokens, so that whoever makes rollouts cannot change the policy:

- **data** (``auth.token``, ``ROLLMESH_TOKEN``): generation, buffer puts and gets, admission,
  rewards, EnvManager control. Held by every process of the mesh.
- **control** (``auth.control_token``, ``ROLLMESH_CONTROL_TOKEN``): weights, suspend/resume, memory,
  weight-update begin/commit/abort, collective groups, and everything on an engine's HTTP API.
  Held by the trainer, the AsyncController, the LLMProxy and the engines only; `rollmesh run` and the
  deployments give it to no other process.

Each gRPC method has one role (``role_of``: the control ones are listed, the rest are data), and a
call carries that role's token: a data token on a control method is refused (PERMISSION_DENIED).
Environment providers check a token of their own (``env.token_env``), gateway agents API keys of
their own (``services/gateway/keys.py``); neither is ever one of these.

The tokens come from the config or the environment. `rollmesh run` makes fresh ones per run and
hands them to its processes through the environment (a command line would show them in ``ps``); a
cluster mounts them from Secrets. A service refuses to start without the tokens its methods need
unless ``auth.disabled`` says the network is closed to everyone else.

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
from enum import StrEnum
from pathlib import Path

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

log = logging.getLogger(__name__)
TOKEN_ENV = "ROLLMESH_TOKEN"
CONTROL_TOKEN_ENV = "ROLLMESH_CONTROL_TOKEN"
# Set by an engine process started with auth disabled: the vLLM plugin otherwise refuses to serve
# without a token (an empty one must not mean "open").
AUTH_DISABLED_ENV = "ROLLMESH_AUTH_DISABLED"
EXEMPT_GRPC_PREFIX = "/grpc.health.v1.Health/"
EXEMPT_HTTP_PATHS = frozenset({"/health", "/metrics"})


class AuthError(RuntimeError):
    """No token where one is required: the process cannot serve or call safely."""


class Role(StrEnum):
    DATA = "data"
    CONTROL = "control"


TOKEN_ENVS = {Role.DATA: TOKEN_ENV, Role.CONTROL: CONTROL_TOKEN_ENV}
PROVIDER_TOKEN_ENV = "ROLLMESH_PROVIDER_TOKEN"  # environment providers' own (provider_auth)

# The control methods, per gRPC service; every other method of the mesh's services is data. A test
# checks each name against the protos, so a renamed method cannot silently become data.
CONTROL_METHODS = {
    "rollmesh.v1.LLMProxy": frozenset(
        {
            "Suspend",
            "Resume",
            "UpdateWeights",
            "UpdateWeightsBucket",
            "InitWeightsGroup",
            "UpdateWeightsDistributed",
            "ReleaseMemory",
            "ResumeMemory",
        }
    ),
    "rollmesh.v1.AsyncController": frozenset({"BeginUpdate", "CommitUpdate", "AbortUpdate"}),
}


def role_of(method: str) -> Role:
    """The role of a gRPC method, given as ``/package.Service/Method``."""
    service, _, name = method.lstrip("/").partition("/")
    return Role.CONTROL if name in CONTROL_METHODS.get(service, ()) else Role.DATA


def roles_served(service: str) -> set[Role]:
    """The roles whose tokens a gRPC service checks."""
    return {Role.DATA, Role.CONTROL} if service in CONTROL_METHODS else {Role.DATA}


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


def _from_env(name: str):
    def read() -> SecretStr | None:
        value = os.environ.get(name)
        return SecretStr(value) if value else None

    return read


class AuthConfig(BaseModel):
    """The run's secrets and transport security; every service and client of a mesh reads the same
    section, and each process holds the tokens of its roles only."""

    model_config = ConfigDict(extra="forbid")

    token: SecretStr | None = Field(
        default_factory=_from_env(TOKEN_ENV),
        description=f"The data token (rollouts, buffer, rewards); default: ${TOKEN_ENV}. "
        "`rollmesh run` makes one per run.",
    )
    control_token: SecretStr | None = Field(
        default_factory=_from_env(CONTROL_TOKEN_ENV),
        description=f"The control token (weights, suspend/resume, updates, engines' HTTP API); default: "
        f"${CONTROL_TOKEN_ENV}. `rollmesh run` makes one per run and gives it to the trainer, controller, "
        "LLMProxy and engines only.",
    )
    disabled: bool = Field(
        False, description="Serve and call without a token: only on a network nobody else can reach."
    )
    tls: TlsConfig | None = Field(None, description="TLS for gRPC and HTTP (certificate paths); none: plaintext.")

    def secret(self, role: Role) -> SecretStr | None:
        return self.token if role is Role.DATA else self.control_token

    def holds(self, role: Role) -> bool:
        secret = self.secret(role)
        return self.disabled or (secret is not None and bool(secret.get_secret_value()))

    def bearer(self, role: Role = Role.DATA) -> str | None:
        """``Bearer <token>`` of ``role``, or None when auth is disabled; ``AuthError`` when this
        process holds no such token."""
        if self.disabled:
            return None
        if not self.holds(role):
            field = "token" if role is Role.DATA else "control_token"
            raise AuthError(
                f"auth.{field}: no {role} token; set {TOKEN_ENVS[role]} (the same in every process of the mesh "
                f"that holds the {role} role) or auth.disabled: true on a closed network"
            )
        return "Bearer " + self.secret(role).get_secret_value()

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
    """Give ``auth`` fresh random data and control tokens where it has none (and is not disabled),
    exported through the environment so the processes this one starts share them."""
    if not auth.disabled:
        for role, name in TOKEN_ENVS.items():
            if auth.secret(role) is None:
                token = secrets.token_urlsafe(32)
                os.environ[name] = token
                setattr(auth, "token" if role is Role.DATA else "control_token", SecretStr(token))
    return auth


def ensure_provider_token() -> None:
    """A fresh ``ROLLMESH_PROVIDER_TOKEN`` for providers this process starts and calls (benches,
    tests); `rollmesh run` makes none: an external provider's token is its operator's to give."""
    os.environ.setdefault(PROVIDER_TOKEN_ENV, secrets.token_urlsafe(32))


def provider_auth(auth: AuthConfig, token_env: str | None) -> AuthConfig:
    """The auth of an environment provider's API, both sides: the provider's own token from
    ``$token_env`` (never a mesh token: a provider is someone else's code), the mesh's TLS.
    ``token_env`` None: no token (a provider on a closed network that checks none)."""
    if auth.disabled or token_env is None:
        return AuthConfig(token=None, control_token=None, disabled=True, tls=auth.tls)
    token = os.environ.get(token_env)
    if not token:
        raise AuthError(
            f"env.token_env: ${token_env} is not set; an environment provider and its callers share a token of "
            "their own (never the mesh's): export the same value on both sides"
        )
    return AuthConfig(token=SecretStr(token), control_token=None, tls=auth.tls)


def environment_of(roles: set[Role]) -> dict[str, str]:
    """This process's environment without the tokens of roles a child does not hold."""
    dropped = {TOKEN_ENVS[r] for r in Role if r not in roles}
    return {k: v for k, v in os.environ.items() if k not in dropped}


def server_bearer(auth: AuthConfig, server: str, role: Role = Role.DATA) -> str | None:
    """The bearer of ``role`` a server checks. With ``auth.disabled``: None, a warning in the log,
    and ``rollmesh_auth_disabled 1`` on the process's /metrics, so an open service is never a quiet one."""
    bearer = auth.bearer(role)
    if bearer is None:
        SERVING_OPEN.add(server)
        log.warning("%s: auth.disabled: serving WITHOUT a token; anyone who reaches its port may call it", server)
    return bearer


# ---------------------------------------------------------------- refused calls, per process
REFUSED: Counter[str] = Counter({"missing": 0, "wrong": 0, "role": 0})
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


def _matches(got: bytes | str | None, bearer: str) -> bool:
    if got is None:
        return False
    return hmac.compare_digest(got.encode() if isinstance(got, str) else got, bearer.encode())


def _refusal(got: bytes | str | None, expected: str, others: tuple[str, ...] = ()) -> str | None:
    """None when ``got`` is the expected header; else why not, counted: "missing", "wrong", or
    "role" (it is one of ``others``, tokens of a role this method does not take)."""
    if _matches(got, expected):
        return None
    reason = "missing" if got is None else "wrong"
    if any(_matches(got, o) for o in others):
        reason = "role"
    REFUSED[reason] += 1
    return reason


def _message(reason: str, role: Role = Role.DATA, what: str = "") -> str:
    if reason == "role":
        return f"authorization: {what or 'this call'} takes the {role} token ({TOKEN_ENVS[role]}), not another role's"
    send = f"send 'authorization: Bearer <token>', the {role} token {TOKEN_ENVS[role]}"
    return f"authorization: {reason} bearer token ({send})"


# ---------------------------------------------------------------- gRPC
class TokenCheck(grpc.aio.ServerInterceptor):
    """Server side: every RPC but health checks carries ``authorization: Bearer <token>`` of its
    method's role (``bearers``: role → the bearer this server checks; a role it does not serve has none)."""

    def __init__(self, bearers: dict[Role, str], runs: RunTokens | None = None) -> None:
        self.bearers, self.runs = bearers, runs

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_GRPC_PREFIX):
            return handler
        got = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        role = role_of(details.method)
        other_role = Role.CONTROL if role is Role.DATA else Role.DATA
        if self.runs is not None and self.runs.run_of(got, role) is not None:
            return handler  # a run that shares this service, in its role
        others = (self.bearers.get(other_role), *(self.runs.bearers[other_role].values() if self.runs else ()))
        # (A role this server does not serve: no header can match "\0", and the refusal is counted.)
        reason = _refusal(got, self.bearers.get(role) or "\0", tuple(o for o in others if o))
        if reason is None:
            return handler
        code = grpc.StatusCode.PERMISSION_DENIED if reason == "role" else grpc.StatusCode.UNAUTHENTICATED
        message = _message(reason, role, details.method.rsplit("/", 1)[-1])

        async def refuse(requests, context):
            await context.abort(code, message)

        # A streaming-request handler that never reads: the refused call's message is not received (a
        # unary handler gets the whole message before it runs, up to the server's receive limit: one
        # 200 MiB call without a token took the buffer to 700 MB). HTTP/2 flow control stops the
        # sender after a window's worth; the stream is reset with the status.
        make = grpc.stream_stream_rpc_method_handler if handler.unary_stream else grpc.stream_unary_rpc_method_handler
        return make(refuse, request_deserializer=None, response_serializer=handler.response_serializer)


class _AddToken:
    """Client side: each call carries the token of its method's role; a process that holds no such
    token fails the call with ``AuthError`` before anything is sent."""

    def __init__(self, auth: AuthConfig) -> None:
        self.auth = auth

    def _details(self, d):
        method = d.method.decode() if isinstance(d.method, bytes) else d.method
        pair = ("authorization", self.auth.bearer(role_of(method)))
        return d._replace(metadata=grpc.aio.Metadata(*(d.metadata or ()), pair))


# grpc.aio files an interceptor under the first call kind it implements: one class per kind.
class _AddTokenUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AddTokenStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AddTokenStreamUnary(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def grpc_server_credentials(auth: AuthConfig) -> grpc.ServerCredentials | None:
    if auth.tls is None:
        return None
    if auth.tls.cert_path is None:
        raise AuthError("auth.tls.cert_path: a TLS server needs its certificate and key")
    return grpc.ssl_server_credentials([(auth.tls.read("key_path"), auth.tls.read("cert_path"))])


def grpc_server_interceptors(
    auth: AuthConfig, service: str, runs: RunTokens | None = None
) -> list[grpc.aio.ServerInterceptor]:
    """The token check of gRPC service ``service`` (``package.Service``): ``AuthError`` when this
    process lacks a token of a role the service's methods take. ``runs``: the tokens of runs that
    share it, taken too (the handlers tell the runs apart with ``runs.of``)."""
    if auth.disabled:
        server_bearer(auth, service)  # the warning and the gauge
        return []
    return [TokenCheck({role: auth.bearer(role) for role in roles_served(service)}, runs)]


class RunTokens:
    """The data and control tokens of the runs that share a service (``proxy.runs``), read from the
    environment variables each run names: a call's token says which run makes it."""

    def __init__(self, runs: dict, auth: AuthConfig, section: str = "proxy.runs") -> None:
        if auth.disabled and runs:
            raise AuthError(f"{section}: runs are told apart by their tokens, so not with auth.disabled")
        self.bearers: dict[Role, dict[str, str]] = {Role.DATA: {}, Role.CONTROL: {}}
        for name, run in runs.items():
            for role, field in ((Role.DATA, "token_env"), (Role.CONTROL, "control_token_env")):
                env = getattr(run, field)
                value = os.environ.get(env)
                if not value:
                    raise AuthError(
                        f"{section}.{name}.{field}: ${env} is not set; it holds the {role} token of run {name}'s mesh"
                    )
                self.bearers[role][name] = "Bearer " + value
        every = [b for by_run in self.bearers.values() for b in by_run.values()]
        every += [auth.bearer(r) for r in Role if auth.holds(r)] if runs else []
        if len(set(every)) != len(every):
            raise AuthError(f"{section}: every run's two tokens differ from each other run's and from this mesh's")

    def run_of(self, got: bytes | str | None, role: Role) -> str | None:
        return next((name for name, b in self.bearers[role].items() if _matches(got, b)), None)

    def of(self, context) -> str:
        """The run a call that passed ``TokenCheck`` comes from; "" for this mesh's own tokens."""
        got = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
        return next((r for role in Role if (r := self.run_of(got, role)) is not None), "")


def grpc_channel(address: str, auth: AuthConfig, options: list) -> grpc.aio.Channel:
    """An aio channel that carries the tokens (and speaks TLS when configured)."""
    kinds = (_AddTokenUnary, _AddTokenStream, _AddTokenStreamUnary)
    interceptors = None if auth.disabled else [kind(auth) for kind in kinds]
    if auth.tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    creds = grpc.ssl_channel_credentials(root_certificates=auth.tls.read("ca_path"))
    return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)


def grpc_sync_channel(address: str, auth: AuthConfig, options: list | None = None) -> grpc.Channel:
    """A blocking channel (TLS when configured). It adds no token: health checks need none, and a
    blocking caller passes ``auth.bearer(role)`` as the call's ``authorization`` metadata."""
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


def http_headers(auth: AuthConfig, role: Role = Role.CONTROL) -> dict[str, str]:
    """Headers an HTTP client sends: to an engine, the control token (its whole API is control:
    only the LLMProxy and the trainer's side of a weight update call it)."""
    bearer = auth.bearer(role)
    return {"Authorization": bearer} if bearer else {}
