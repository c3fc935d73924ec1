"""Shared gRPC plumbing: strict request decoding, health checking and server start-up.

Handlers receive raw bytes and decode them here, so a malformed or unknown-field message gets
``INVALID_ARGUMENT`` naming the problem (grpcio's own deserializer would answer ``INTERNAL``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sample_buffer.deadlines import wait_for
from services.auth import (
    AuthConfig,
    RunTokens,
    grpc_channel,
    grpc_server_credentials,
    grpc_server_interceptors,
)


def decode(cls: type[Message], raw: bytes) -> Message:
    """Parse ``raw`` as ``cls``; ``ValueError`` for corrupt bytes or fields the contract lacks."""
    try:
        msg = cls.FromString(raw)
    except DecodeError as e:
        raise ValueError(f"body: malformed {cls.DESCRIPTOR.full_name} ({e})") from None
    _reject_unknown(msg, cls.DESCRIPTOR.name)
    return msg


def _reject_unknown(msg: Message, path: str) -> None:
    unknown = list(unknown_fields.UnknownFieldSet(msg))
    if unknown:
        raise ValueError(f"{path}: unknown field number {unknown[0].field_number}")
    for fd, value in msg.ListFields():
        if fd.message_type is None or fd.message_type.GetOptions().map_entry:
            continue
        for i, sub in enumerate(value if fd.is_repeated else [value]):
            _reject_unknown(sub, f"{path}.{fd.name}" + (f"[{i}]" if fd.is_repeated else ""))


# gRPC backs off up to 120 s between reconnects to a peer that refused; a service `rollmesh run`
# (or Kubernetes) restarts is back within seconds, and every call in between would fail fast.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def channel(address: str, options: list | None = None, auth: AuthConfig | None = None) -> grpc.aio.Channel:
    """A client channel that carries the run's token (``auth``; default: from the environment)
    and finds a restarted service again within about two seconds."""
    return grpc_channel(address, auth or AuthConfig(), [*RECONNECT_OPTIONS, *(options or [])])


Handler = Callable[[Message, grpc.aio.ServicerContext], Awaitable[Message]]


async def _acquire(slots: asyncio.Semaphore, method: str, context: grpc.aio.ServicerContext) -> None:
    """A receive slot of ``method`` within 90% of the call's time left (the caller hears why before
    its own deadline passes; a minute without one), else RESOURCE_EXHAUSTED."""
    remaining = context.time_remaining()
    try:
        await wait_for(slots.acquire(), 60.0 if remaining is None else 0.9 * remaining)
    except TimeoutError:
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: every receive slot stayed busy until the call's deadline"
        )


def unary_service(
    service_name: str,
    methods: dict[str, tuple[type[Message], Handler]],
    streams: dict[str, tuple[type[Message], Callable]] | None = None,
    client_streams: dict[str, tuple[type[Message], Callable]] | None = None,
    slots: dict[str, asyncio.Semaphore] | None = None,
) -> grpc.GenericRpcHandler:
    """A generic handler: ``{"Generate": (GenerateRequest, handler)}`` → strict-decoding RPCs;
    ``streams`` maps server-streaming methods to async generator functions, ``client_streams``
    client-streaming ones to functions of an async iterator of decoded messages.

    ``slots``: methods whose messages are received only under one of a bounded number of slots, held
    until the handler returns: what a burst of large calls holds in memory is bounded, the rest wait
    (within their deadlines). gRPC reads a unary handler's message before any code of ours runs, so
    such a method is served as client-streaming (a unary call is a stream of one message on the wire)
    and reads its one message after taking a slot."""
    slots = slots or {}

    def wrap(req_cls: type[Message], fn: Handler):
        async def call(raw: bytes, context: grpc.aio.ServicerContext):
            try:
                request = decode(req_cls, raw)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return await fn(request, context)

        return grpc.unary_unary_rpc_method_handler(
            call, request_deserializer=None, response_serializer=lambda m: m.SerializeToString()
        )

    def wrap_stream(req_cls: type[Message], fn):
        async def call(raw: bytes, context: grpc.aio.ServicerContext):
            try:
                request = decode(req_cls, raw)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            async for item in fn(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(
            call, request_deserializer=None, response_serializer=lambda m: m.SerializeToString()
        )

    def wrap_gated(name: str, req_cls: type[Message], fn: Handler):
        async def call(requests, context: grpc.aio.ServicerContext):
            await _acquire(slots[name], name, context)
            try:
                raw = await anext(aiter(requests), None)
                if raw is None or await anext(aiter(requests), None) is not None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: exactly one message per call")
                try:
                    request = decode(req_cls, raw)
                except ValueError as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                return await fn(request, context)
            finally:
                slots[name].release()

        return grpc.stream_unary_rpc_method_handler(
            call, request_deserializer=None, response_serializer=lambda m: m.SerializeToString()
        )

    def wrap_client_stream(name: str, req_cls: type[Message], fn):
        async def call(requests, context: grpc.aio.ServicerContext):
            async def decoded():
                async for raw in requests:
                    try:
                        yield decode(req_cls, raw)
                    except ValueError as e:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

            gate = slots.get(name)
            if gate is None:
                return await fn(decoded(), context)
            await _acquire(gate, name, context)
            try:
                return await fn(decoded(), context)
            finally:
                gate.release()

        return grpc.stream_unary_rpc_method_handler(
            call, request_deserializer=None, response_serializer=lambda m: m.SerializeToString()
        )

    handlers = {
        name: wrap_gated(name, cls, fn) if name in slots else wrap(cls, fn) for name, (cls, fn) in methods.items()
    }
    handlers |= {name: wrap_stream(cls, fn) for name, (cls, fn) in (streams or {}).items()}
    handlers |= {name: wrap_client_stream(name, cls, fn) for name, (cls, fn) in (client_streams or {}).items()}
    return grpc.method_handlers_generic_handler(service_name, handlers)


# gRPC core cancels (CANCELLED) every call beyond 1,000 that arrived but is not yet picked up by the
# server's handlers. An EnvManager opening a step's generations at once (3 steps x 80 groups x 8 at
# async_ratio 2 in `bench async`) sends ~2,000, and a tenth of them failed. The calls are small and
# each already has a deadline, so a burst may wait instead.
MAX_PENDING_CALLS = 100_000
SERVER_OPTIONS = [
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
]


async def start_server(
    handler: grpc.GenericRpcHandler,
    service_name: str,
    host: str,
    port: int,
    options: list | None = None,
    auth: AuthConfig | None = None,
    runs: RunTokens | None = None,
) -> grpc.aio.Server:
    """Start a grpc.aio server with health checking; returns it started (``port`` 0 picks one).
    Every call but health checks must carry ``auth``'s token (default: from the environment), or
    the token of one of the ``runs`` that share the service."""
    auth = auth or AuthConfig()
    server = grpc.aio.server(
        options=[("grpc.so_reuseport", 0), *SERVER_OPTIONS, *(options or [])],
        interceptors=grpc_server_interceptors(auth, service_name, runs),
    )
    server.add_generic_rpc_handlers((handler,))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    creds = grpc_server_credentials(auth)
    address = f"{host}:{port}"
    bound = server.add_insecure_port(address) if creds is None else server.add_secure_port(address, creds)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    server.bound_port = bound
    await server.start()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server


def serve_until_signal(start: Callable[[], Awaitable[tuple[grpc.aio.Server, Callable[[], Awaitable[None]]]]]) -> None:
    """Run a service process: ``start()`` returns (its gRPC server, its clean-up). Serves under uvloop
    (about 30% less CPU per request than asyncio's loop here) until SIGTERM or SIGINT, then stops
    the server with a grace period and cleans up."""
    import gc
    import signal

    import uvloop

    async def main() -> None:
        server, cleanup = await start()
        # Start-up objects (grpc, torch, ...) live as long as the process: keeping full GC passes
        # from walking them removes 200+ ms latency tails.
        gc.freeze()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(grace=5)
        await cleanup()

    uvloop.run(main())
