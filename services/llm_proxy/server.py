"""gRPC LLMProxy service: a thin adapter over ``rollout.proxy.LLMProxy``."""

from __future__ import annotations

import logging

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rollout.proxy import LLMProxy, ProxyConfig, ProxyRequest, RequestInvalid
from rollout.proxy.proxy import NoEngineAvailable
from services.grpc_util import serve_until_signal, start_server, unary_service
from services.pb.rollmesh.v1 import common_pb2
from services.pb.rollmesh.v1 import llm_proxy_pb2 as pb

log = logging.getLogger(__name__)
SERVICE = "rollmesh.v1.LLMProxy"

_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "timeout": common_pb2.FINISH_REASON_TIMEOUT,
}
_MODES = {
    pb.SUSPEND_MODE_UNSPECIFIED: "continue",
    pb.SUSPEND_MODE_CONTINUE: "continue",
    pb.SUSPEND_MODE_ABORT: "abort",
    pb.SUSPEND_MODE_IN_PLACE: "in_place",
}


def sampling_dict(sp: pb.SamplingParams) -> dict:
    """Proto sampling params → SGLang's ``sampling_params`` (unset optionals left to the engine)."""
    out: dict = {"max_new_tokens": sp.max_new_tokens}
    for name in ("temperature", "top_p", "top_k", "sampling_seed"):
        if sp.HasField(name):
            out[name] = getattr(sp, name)
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.ignore_eos:
        out["ignore_eos"] = True
    return out


class ProxyMetrics:
    def __init__(self, proxy: LLMProxy) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("rollmesh_proxy_requests", "Generate calls by finish reason", ["finish"], registry=r)
        self.tokens = Counter("rollmesh_proxy_generated_tokens", "Tokens returned", ["engine"], registry=r)
        self.latency = Histogram(
            "rollmesh_proxy_generate_latency_seconds",
            "Generate latency seen by callers",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.updates = Counter("rollmesh_proxy_weight_updates", "Weight updates by result", ["result"], registry=r)
        self.update_seconds = Histogram(
            "rollmesh_proxy_weight_update_duration_seconds", "Fan-out weight update duration", registry=r
        )
        Gauge("rollmesh_proxy_in_flight_requests", "Generate calls in flight", registry=r).set_function(
            lambda: len(proxy._in_flight)
        )
        Gauge("rollmesh_proxy_suspended", "1 while the suspend gate is closed", registry=r).set_function(
            lambda: float(proxy.suspended)
        )
        Gauge("rollmesh_proxy_weight_version", "Weight version every engine confirmed", registry=r).set_function(
            lambda: proxy.weight_version
        )
        Gauge("rollmesh_proxy_engines_in_rotation", "Engines answering health checks", registry=r).set_function(
            lambda: sum(s.healthy for s in proxy.router.engines)
        )
        Gauge("rollmesh_proxy_retries", "Requests retried on another engine (total)", registry=r).set_function(
            lambda: proxy.counters["retries"]
        )


def build_handler(proxy: LLMProxy, metrics: ProxyMetrics) -> grpc.GenericRpcHandler:
    async def generate(req: pb.GenerateRequest, ctx) -> pb.GenerateResponse:
        preq = ProxyRequest(
            input_ids=list(req.input_ids),
            sampling_params=sampling_dict(req.sampling_params),
            request_id=req.request_id,
            trajectory_id=req.trajectory_id,
            timeout_s=req.timeout_s,
        )
        try:
            res = await proxy.generate(preq)
        except RequestInvalid as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoEngineAvailable as e:
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        metrics.requests.labels(res.finish_type).inc()
        metrics.tokens.labels(res.engine or "none").inc(len(res.output_ids))
        metrics.latency.observe(res.e2e_latency_s)
        return pb.GenerateResponse(
            request_id=res.request_id,
            output_ids=res.output_ids,
            output_logprobs=res.output_logprobs,
            token_versions=res.token_versions,
            finish_reason=_FINISH.get(res.finish_type, common_pb2.FINISH_REASON_ERROR),
            weight_version=res.weight_version,
            engine=res.engine,
            prompt_tokens=res.prompt_tokens,
            e2e_latency_s=res.e2e_latency_s,
            num_segments=res.num_segments,
        )

    async def abort(req: pb.AbortRequest, ctx) -> pb.AbortResponse:
        if not req.request_id and not req.abort_all:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: give one or set abort_all")
        return pb.AbortResponse(num_aborted=await proxy.abort(req.request_id, req.abort_all))

    async def suspend(req: pb.SuspendRequest, ctx) -> pb.SuspendResponse:
        if req.mode not in _MODES:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"mode: unknown suspend mode {req.mode}")
        return pb.SuspendResponse(num_in_flight=await proxy.suspend(_MODES[req.mode], req.timeout_s))

    async def resume(req: pb.ResumeRequest, ctx) -> pb.ResumeResponse:
        await proxy.resume(req.timeout_s)
        return pb.ResumeResponse()

    async def update_weights(req: pb.UpdateWeightsRequest, ctx) -> pb.UpdateWeightsResponse:
        try:
            with metrics.update_seconds.time():
                ok, results = await proxy.update_weights(req.model_path, req.weight_version, req.timeout_s)
        except RequestInvalid as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        metrics.updates.labels("ok" if ok else "failed").inc()
        return pb.UpdateWeightsResponse(success=ok, engines=[pb.EngineUpdateResult(**r) for r in results])

    async def stats(req: pb.StatsRequest, ctx) -> pb.ProxyStats:
        s = proxy.stats()
        engines = [
            pb.EngineStats(
                name=e["name"],
                url=e["url"],
                healthy=e["healthy"],
                in_flight=e["in_flight"],
                outstanding_tokens=e["outstanding_tokens"],
                weight_version=e["weight_version"],
                requests_total=e["requests_total"],
                failures_total=e["failures_total"],
            )
            for e in s.pop("engines")
        ]
        return pb.ProxyStats(**s, engines=engines)

    return unary_service(
        SERVICE,
        {
            "Generate": (pb.GenerateRequest, generate),
            "Abort": (pb.AbortRequest, abort),
            "Suspend": (pb.SuspendRequest, suspend),
            "Resume": (pb.ResumeRequest, resume),
            "UpdateWeights": (pb.UpdateWeightsRequest, update_weights),
            "Stats": (pb.StatsRequest, stats),
        },
    )


async def start_proxy(config: ProxyConfig) -> tuple[grpc.aio.Server, LLMProxy]:
    """Start the proxy (engine health first), its gRPC server and its metrics endpoint."""
    proxy = await LLMProxy(config).start()
    metrics = ProxyMetrics(proxy)
    server = await start_server(build_handler(proxy, metrics), SERVICE, config.host, config.port)
    if config.metrics_port:
        start_http_server(config.metrics_port, addr=config.host, registry=metrics.registry)
    return server, proxy


def serve(config: ProxyConfig) -> None:
    async def start():
        server, proxy = await start_proxy(config)
        log.info("LLMProxy serving on %s:%d for %d engines", config.host, server.bound_port, len(config.engine_urls))
        return server, proxy.close

    serve_until_signal(start)
