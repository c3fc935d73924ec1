"""gRPC LLMProxy service: a thin adapter over ``rollout.proxy.LLMProxy``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid

import grpc
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rollout.engines.http_engine import HTTPEngineClient
from rollout.proxy import UPDATE_FAILURE_CAUSES, LLMProxy, NoEngineAvailable, ProxyConfig, ProxyRequest, RequestInvalid
from sample_buffer.trajectory import FinishReason
from services.auth import AuthConfig, RunTokens, http_headers
from services.convert import finish_to_pb, routed_experts_to_pb, sampling_from_pb
from services.engine.backends import ENGINE_APIS
from services.grpc_util import serve_until_signal, start_server, unary_service
from services.metrics import SLOW_BUCKETS_S, histogram, init_labels, serve_metrics
from services.pb.rollmesh.v1 import llm_proxy_pb2 as pb
from services.streams import until_done
from services.wire_limits import BOUNDED_WINDOW_OPTIONS, MAX_WEIGHT_BUCKET_MB, PROXY_MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)
SERVICE = "rollmesh.v1.LLMProxy"

_MODES = {
    pb.SUSPEND_MODE_UNSPECIFIED: "continue",
    pb.SUSPEND_MODE_CONTINUE: "continue",
    pb.SUSPEND_MODE_ABORT: "abort",
    pb.SUSPEND_MODE_IN_PLACE: "in_place",
}


class _EngineCollector:
    """Per-engine gauges read from the router at scrape time (engines come and go)."""

    def __init__(self, proxy: LLMProxy) -> None:
        self.proxy = proxy

    def collect(self):
        p = self.proxy
        families = {
            "up": GaugeMetricFamily("rollmesh_proxy_engine_up", "1 while the engine is in rotation", labels=["engine"]),
            "version": GaugeMetricFamily(
                "rollmesh_proxy_engine_weight_version", "Weight version the engine last confirmed", labels=["engine"]
            ),
            "in_flight": GaugeMetricFamily(
                "rollmesh_proxy_engine_in_flight_requests", "Engine calls in flight", labels=["engine"]
            ),
            "outstanding": GaugeMetricFamily(
                "rollmesh_proxy_engine_outstanding_tokens",
                "Prompt + max_new_tokens of calls in flight",
                labels=["engine"],
            ),
            "failures": CounterMetricFamily(
                "rollmesh_proxy_engine_failures", "Times the engine was taken out of rotation", labels=["engine"]
            ),
        }
        for e in p.router.engines:
            families["up"].add_metric([e.name], float(e.healthy))
            families["version"].add_metric([e.name], e.weight_version)
            families["in_flight"].add_metric([e.name], e.in_flight)
            families["outstanding"].add_metric([e.name], e.outstanding_tokens)
            families["failures"].add_metric([e.name], e.failures_total)
        yield from families.values()
        yield GaugeMetricFamily(
            "rollmesh_proxy_in_flight_requests", "Generate calls in flight", value=len(p._in_flight)
        )
        yield GaugeMetricFamily("rollmesh_proxy_suspended", "1 while the suspend gate is closed", value=p.suspended)
        yield GaugeMetricFamily(
            "rollmesh_proxy_weight_version", "Weight version every engine confirmed", value=p.weight_version
        )
        yield GaugeMetricFamily(
            "rollmesh_proxy_engines_configured", "Engines behind this proxy", value=len(p.router.engines)
        )
        yield GaugeMetricFamily(
            "rollmesh_proxy_engines_in_rotation",
            "Engines answering health checks",
            value=sum(e.healthy for e in p.router.engines),
        )
        yield CounterMetricFamily(
            "rollmesh_proxy_retries", "Requests retried on another engine", value=p.counters["retries"]
        )
        yield CounterMetricFamily(
            "rollmesh_proxy_adapter_unloads_refused",
            "Adapter unloads an engine refused (in use): tried again later",
            value=p.counters["adapter_unloads_refused"],
        )
        runs = {
            "version": GaugeMetricFamily(
                "rollmesh_proxy_run_weight_version", "A shared run's policy version (proxy.runs)", labels=["run"]
            ),
            "suspended": GaugeMetricFamily(
                "rollmesh_proxy_run_suspended", "1 while a shared run's requests are suspended", labels=["run"]
            ),
            "in_flight": GaugeMetricFamily(
                "rollmesh_proxy_run_in_flight_requests", "A shared run's Generate calls in flight", labels=["run"]
            ),
        }
        for name in list(p.lanes)[1:]:
            st = p.stats(name)
            runs["version"].add_metric([name], st["weight_version"])
            runs["suspended"].add_metric([name], float(st["suspended"]))
            runs["in_flight"].add_metric([name], st["in_flight"])
        yield from runs.values()


class ProxyMetrics:
    def __init__(self, proxy: LLMProxy) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "rollmesh_proxy_requests", "Generate calls, by engine and finish reason", ["engine", "finish"], registry=r
        )
        self.tokens = Counter("rollmesh_proxy_generated_tokens", "Tokens returned, by engine", ["engine"], registry=r)
        self.prompt_tokens = Counter(
            "rollmesh_proxy_prompt_tokens", "Prompt tokens of answered calls, by engine", ["engine"], registry=r
        )
        for e in proxy.router.engines:
            init_labels(self.tokens, e.name)
            init_labels(self.prompt_tokens, e.name)
            for finish in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT, FinishReason.TIMEOUT):
                self.requests.labels(e.name, finish)
        self.latency = histogram(
            r, "rollmesh_proxy_generate_latency_seconds", "Generate latency seen by callers (suspensions included)"
        )
        self.ttft = histogram(
            r, "rollmesh_proxy_time_to_first_token_seconds", "Arrival to first token (engines that report their TTFT)"
        )
        self.queue = histogram(
            r, "rollmesh_proxy_queue_time_seconds", "Waiting at the suspend gate plus in the engine's queue"
        )
        self.updates = Counter("rollmesh_proxy_weight_updates", "Weight updates, by result", ["result"], registry=r)
        init_labels(self.updates, "ok", "failed")
        self.update_failures = Counter(
            "rollmesh_proxy_weight_update_failures",
            "Engines that failed a weight update, by cause",
            ["cause"],
            registry=r,
        )
        init_labels(self.update_failures, *UPDATE_FAILURE_CAUSES)
        self.update_seconds = histogram(
            r, "rollmesh_proxy_weight_update_duration_seconds", "Fan-out weight update duration", SLOW_BUCKETS_S
        )
        r.register(_EngineCollector(proxy))

    def observe(self, res) -> None:
        engine = res.engine or "none"
        self.requests.labels(engine, res.finish_reason).inc()
        self.tokens.labels(engine).inc(len(res.output_ids))
        self.prompt_tokens.labels(engine).inc(res.prompt_tokens)
        self.latency.observe(res.e2e_latency_s)
        self.queue.observe(res.queue_time_s)
        if res.ttft_s is not None:
            self.ttft.observe(res.ttft_s)

    def observe_update(self, ok: bool, results: list[dict]) -> None:
        self.updates.labels("ok" if ok else "failed").inc()
        for r in results:
            if not r["success"]:
                self.update_failures.labels(r.get("cause") or "error").inc()


def _request(req: pb.GenerateRequest) -> ProxyRequest:
    return ProxyRequest(
        input_ids=list(req.input_ids),
        sampling_params=sampling_from_pb(req.sampling_params),
        request_id=req.request_id,
        route=req.route,
        timeout_s=req.timeout_s,
        top_logprobs=req.top_logprobs,
        return_routed_experts=req.return_routed_experts,
        images=tuple(req.images),
    )


def _response(res) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=res.request_id,
        output_ids=res.output_ids,
        behavior_logprobs=res.behavior_logprobs,
        token_versions=res.token_versions,
        finish_reason=finish_to_pb(res.finish_reason),
        weight_version=res.weight_version,
        engine=res.engine,
        prompt_tokens=res.prompt_tokens,
        e2e_latency_s=res.e2e_latency_s,
        num_segments=res.num_segments,
        top_logprobs=[
            pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top]) for top in res.top_logprobs
        ],
        routed_experts=None if res.routed_experts is None else routed_experts_to_pb(res.routed_experts),
    )


def build_handler(proxy: LLMProxy, metrics: ProxyMetrics, runs: RunTokens | None = None) -> grpc.GenericRpcHandler:
    """``runs``: the tokens of the runs that share the engines (``proxy.runs``); a call's token
    decides whose lane it acts on, never a field of the request."""

    def run_of(ctx) -> str:
        return runs.of(ctx) if runs is not None else ""

    async def owner_only(ctx, what: str) -> None:
        try:
            proxy.owns_weights(run_of(ctx), what)
        except RequestInvalid as e:
            await ctx.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))

    async def generate(req: pb.GenerateRequest, ctx) -> pb.GenerateResponse:
        try:
            res = await proxy.generate(_request(req), run=run_of(ctx))
        except RequestInvalid as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoEngineAvailable as e:
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        metrics.observe(res)
        return _response(res)

    async def generate_group(req: pb.GenerateGroupRequest, ctx) -> pb.GenerateGroupResponse:
        try:
            results = await proxy.generate_group(_request(req.request), list(req.request_ids), run=run_of(ctx))
        except RequestInvalid as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoEngineAvailable as e:
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        for res in results:
            metrics.observe(res)
        return pb.GenerateGroupResponse(samples=[_response(res) for res in results])

    async def generate_stream(req: pb.GenerateRequest, ctx):
        """Chunks of new tokens as the engines make them, then the result. A caller that goes away
        aborts the generation."""
        preq = _request(req)
        preq.request_id = preq.request_id or uuid.uuid4().hex  # known here: the abort below needs it
        pieces: asyncio.Queue[list[int]] = asyncio.Queue()
        task = asyncio.ensure_future(proxy.generate(preq, on_tokens=pieces.put_nowait, run=run_of(ctx)))
        try:
            async for ids in until_done(pieces, task):
                yield pb.GenerateChunk(output_ids=ids)
            try:
                res = task.result()
            except RequestInvalid as e:
                await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except NoEngineAvailable as e:
                await ctx.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            metrics.observe(res)
            yield pb.GenerateChunk(result=_response(res))
        finally:
            if not task.done():  # the caller went away mid-stream
                await proxy.abort(preq.request_id, run=run_of(ctx))
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(task, proxy.config.abort_grace_s)

    async def abort(req: pb.AbortRequest, ctx) -> pb.AbortResponse:
        if not req.request_id and not req.abort_all:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: give one or set abort_all")
        return pb.AbortResponse(num_aborted=await proxy.abort(req.request_id, req.abort_all, run_of(ctx)))

    async def suspend(req: pb.SuspendRequest, ctx) -> pb.SuspendResponse:
        if req.mode not in _MODES:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"mode: unknown suspend mode {req.mode}")
        try:
            n = await proxy.suspend(_MODES[req.mode], req.timeout_s, run_of(ctx))
            return pb.SuspendResponse(num_in_flight=n)
        except RequestInvalid as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def resume(req: pb.ResumeRequest, ctx) -> pb.ResumeResponse:
        try:
            await proxy.resume(req.timeout_s, run_of(ctx))
        except RequestInvalid as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.ResumeResponse()

    async def update_weights(req: pb.UpdateWeightsRequest, ctx) -> pb.UpdateWeightsResponse:
        if not req.adapter:
            await owner_only(ctx, "a full-weight update")
        try:
            with metrics.update_seconds.time():
                ok, results = await proxy.update_weights(
                    req.model_path, req.weight_version, req.timeout_s, run_of(ctx), req.adapter
                )
        except RequestInvalid as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        metrics.observe_update(ok, results)
        return pb.UpdateWeightsResponse(success=ok, engines=[pb.EngineUpdateResult(**r) for r in results])

    async def update_weights_bucket(pieces, ctx) -> pb.UpdateWeightsResponse:
        await owner_only(ctx, "an in-memory weight update")
        req, data = await receive_bucket(pieces, ctx)
        try:
            ok, results = await proxy.update_weights_bucket(
                req.weight_version,
                req.index,
                data,
                req.final,
                req.restore_path,
                req.timeout_s,
                req.format,
                req.base_version,
                req.checksum,
            )
        except RequestInvalid as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if req.final or not ok:  # the update ended
            metrics.observe_update(ok, results)
        return pb.UpdateWeightsResponse(success=ok, engines=[pb.EngineUpdateResult(**r) for r in results])

    async def init_weights_group(req: pb.InitWeightsGroupRequest, ctx) -> pb.InitWeightsGroupResponse:
        await owner_only(ctx, "a weight-update group")
        try:
            world, engines = await proxy.init_weights_group(
                req.master_address, req.master_port, req.group_name, req.backend, req.timeout_s
            )
        except RequestInvalid as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.InitWeightsGroupResponse(world_size=world, engines=engines)

    async def update_weights_distributed(req: pb.DistributedBucket, ctx) -> pb.UpdateWeightsResponse:
        await owner_only(ctx, "a collective weight update")
        try:
            ok, results = await proxy.update_weights_distributed(
                req.weight_version,
                req.index,
                [t.name for t in req.tensors],
                [t.dtype for t in req.tensors],
                [list(t.shape) for t in req.tensors],
                req.final,
                req.restore_path,
                req.checksum,
                req.timeout_s,
                req.adapter,
                req.result_checksum,
            )
        except RequestInvalid as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if req.final or not ok:
            metrics.observe_update(ok, results)
        return pb.UpdateWeightsResponse(success=ok, engines=[pb.EngineUpdateResult(**r) for r in results])

    async def release_memory(req: pb.MemoryRequest, ctx) -> pb.MemoryResponse:
        await owner_only(ctx, "releasing memory")
        try:
            ok, results = await proxy.release_memory(list(req.tags), req.lease_s, req.timeout_s)
        except RequestInvalid as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.MemoryResponse(success=ok, engines=[pb.EngineUpdateResult(**r) for r in results])

    async def resume_memory(req: pb.MemoryRequest, ctx) -> pb.MemoryResponse:
        await owner_only(ctx, "taking memory back")
        try:
            ok, results = await proxy.resume_memory(list(req.tags), req.timeout_s)
        except RequestInvalid as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.MemoryResponse(success=ok, engines=[pb.EngineUpdateResult(**r) for r in results])

    async def stats(req: pb.StatsRequest, ctx) -> pb.ProxyStats:
        s = proxy.stats(run_of(ctx))
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
            "GenerateGroup": (pb.GenerateGroupRequest, generate_group),
            "Abort": (pb.AbortRequest, abort),
            "Suspend": (pb.SuspendRequest, suspend),
            "Resume": (pb.ResumeRequest, resume),
            "UpdateWeights": (pb.UpdateWeightsRequest, update_weights),
            "InitWeightsGroup": (pb.InitWeightsGroupRequest, init_weights_group),
            "UpdateWeightsDistributed": (pb.DistributedBucket, update_weights_distributed),
            "ReleaseMemory": (pb.MemoryRequest, release_memory),
            "ResumeMemory": (pb.MemoryRequest, resume_memory),
            "Stats": (pb.StatsRequest, stats),
        },
        streams={"GenerateStream": (pb.GenerateRequest, generate_stream)},
        client_streams={"UpdateWeightsBucket": (pb.WeightBucket, update_weights_bucket)},
        # One bucket in memory at a time (updates apply one after another anyway); a second waits.
        slots={"UpdateWeightsBucket": asyncio.Semaphore(1)},
    )


async def receive_bucket(pieces, ctx) -> tuple[pb.WeightBucket, bytearray]:
    """A bucket's pieces: the first's fields and all their ``safetensors`` bytes, grown in place (a
    large bytearray grows by remapping, not copying: about one bucket in memory, not two); refused
    as soon as they pass MAX_WEIGHT_BUCKET_MB."""
    first, data = None, bytearray()
    async for piece in pieces:
        if first is None:
            first = piece
        elif any(field.name != "safetensors" for field, _ in piece.ListFields()):
            await ctx.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "WeightBucket: a later piece carries more than safetensors"
            )
        if len(data) + len(piece.safetensors) > MAX_WEIGHT_BUCKET_MB << 20:
            await ctx.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"safetensors: a bucket is at most {MAX_WEIGHT_BUCKET_MB} MiB"
            )
        data += piece.safetensors
    if first is None:
        await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "WeightBucket: no message")
    first.ClearField("safetensors")
    return first, data


async def start_proxy(config: ProxyConfig, auth: AuthConfig | None = None) -> tuple[grpc.aio.Server, LLMProxy]:
    """Start the proxy (engine health first), its gRPC server and its metrics endpoint. ``auth``
    (default: from the environment) guards its RPCs and goes with every call to an engine."""
    auth = auth or AuthConfig()
    clients = functools.partial(engine_client, auth=auth, api=config.engine_api)
    runs = RunTokens(config.runs, auth)  # before anything starts: a run without its tokens is refused
    proxy = await LLMProxy(config, client_factory=clients).start()
    metrics = ProxyMetrics(proxy)
    server = await start_server(
        build_handler(proxy, metrics, runs),
        SERVICE,
        config.host,
        config.port,
        [*BOUNDED_WINDOW_OPTIONS, ("grpc.max_receive_message_length", PROXY_MAX_MESSAGE_BYTES)],
        auth=auth,
        runs=runs,
    )
    serve_metrics(metrics.registry, config.host, config.metrics_port, "LLMProxy")
    return server, proxy


def engine_client(url: str, auth: AuthConfig | None = None, api: str = "sglang", **kwargs) -> HTTPEngineClient:
    """A client of the engine at ``url`` speaking ``api`` (``ProxyConfig.engine_api``) that carries
    the run's token and trusts its CA (``auth``; default: from the environment): how the proxy,
    benchmarks and tools call an engine."""
    auth = auth or AuthConfig()
    return ENGINE_APIS[api](url, headers=http_headers(auth), ssl_context=auth.client_ssl(), **kwargs)


def serve(config: ProxyConfig, auth: AuthConfig) -> None:
    async def start():
        server, proxy = await start_proxy(config, auth)
        log.info("LLMProxy serving on %s:%d for %d engines", config.host, server.bound_port, len(config.engine_urls))
        return server, proxy.close

    serve_until_signal(start)
