"""gRPC LLMProxy service: a thin adapter over ``rollout.proxy.LLMProxy``."""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc

from rollout.engines.http_engine import HTTPEngineClient
from rollout.proxy import LLMProxy, ProxyConfig
from services.auth import AuthConfig, RunTokens, http_headers
from services.engine.backends import ENGINE_APIS
from services.grpc_util import serve_until_signal, start_server, unary_service
from services.llm_proxy.control_handlers import ControlHandlers
from services.llm_proxy.generate_handlers import GenerateHandlers
from services.llm_proxy.metrics import ProxyMetrics
from services.metrics import serve_metrics
from services.pb.rollmesh.v1 import llm_proxy_pb2 as pb
from services.wire_limits import BOUNDED_WINDOW_OPTIONS, PROXY_MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)
SERVICE = "rollmesh.v1.LLMProxy"


def build_handler(proxy: LLMProxy, metrics: ProxyMetrics, runs: RunTokens | None = None) -> grpc.GenericRpcHandler:
    """``runs``: the tokens of the runs that share the engines (``proxy.runs``); a call's token
    decides whose lane it acts on, never a field of the request."""
    gen, ctl = GenerateHandlers(proxy, metrics, runs), ControlHandlers(proxy, metrics, runs)
    return unary_service(
        SERVICE,
        {
            "Generate": (pb.GenerateRequest, gen.generate),
            "GenerateGroup": (pb.GenerateGroupRequest, gen.generate_group),
            "Abort": (pb.AbortRequest, gen.abort),
            "ScoreTokens": (pb.ScoreTokensRequest, gen.score_tokens),
            "Suspend": (pb.SuspendRequest, ctl.suspend),
            "Resume": (pb.ResumeRequest, ctl.resume),
            "UpdateWeights": (pb.UpdateWeightsRequest, ctl.update_weights),
            "InitWeightsGroup": (pb.InitWeightsGroupRequest, ctl.init_weights_group),
            "UpdateWeightsDistributed": (pb.DistributedBucket, ctl.update_weights_distributed),
            "ReleaseMemory": (pb.MemoryRequest, ctl.release_memory),
            "ResumeMemory": (pb.MemoryRequest, ctl.resume_memory),
            "Stats": (pb.StatsRequest, ctl.stats),
        },
        streams={"GenerateStream": (pb.GenerateRequest, gen.generate_stream)},
        client_streams={"UpdateWeightsBucket": (pb.WeightBucket, ctl.update_weights_bucket)},
        # One bucket in memory at a time (updates apply one after another anyway); a second waits.
        slots={"UpdateWeightsBucket": asyncio.Semaphore(1)},
    )


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
