"""gRPC SampleBuffer service: a thin adapter over ``sample_buffer.SampleBuffer``."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sample_buffer.backends import make_buffer
from sample_buffer.buffer import BufferBackendError, SampleBuffer
from sample_buffer.codec import CodecError, read_header
from sample_buffer.config import BufferConfig
from sample_buffer.trajectory import PutRefusal
from services.auth import AuthConfig
from services.grpc_util import serve_until_signal, start_server, unary_service
from services.metrics import AGE_BUCKETS_S, VERSION_BUCKETS, histogram, init_labels, serve_metrics
from services.pb.rollmesh.v1 import sample_buffer_pb2 as pb
from services.wire_limits import BOUNDED_WINDOW_OPTIONS, SAMPLE_BUFFER_MAX_MESSAGE_BYTES, SAMPLE_BUFFER_MAX_PUT_BYTES

log = logging.getLogger(__name__)
SERVICE = "rollmesh.v1.SampleBuffer"
DROP_REASONS = ("stale", "filtered", "capacity", "corrupt")


class BufferMetrics:
    """Per-RPC histograms plus the buffer's own counters, refreshed in the background."""

    def __init__(self, capacity_groups: int = 0) -> None:
        self.registry = r = CollectorRegistry()
        self.capacity_groups = capacity_groups
        self.latest: dict = {}
        self.puts = Counter(
            "rollmesh_buffer_put_groups_by_result", "Groups offered to Put, by result", ["result"], registry=r
        )
        init_labels(self.puts, "accepted", "filtered", "full", "invalid")
        self.got = Counter("rollmesh_buffer_handed_out_groups", "Groups handed out by Get", registry=r)
        self.get_seconds = histogram(r, "rollmesh_buffer_get_latency_seconds", "Get latency, waiting included")
        self.staleness = histogram(
            r,
            "rollmesh_buffer_staleness_versions",
            "the trainer's version - start_version of each group handed out",
            VERSION_BUCKETS,
        )
        self.age = histogram(
            r, "rollmesh_buffer_age_seconds", "Time from encoding to hand-out of each group", AGE_BUCKETS_S
        )
        r.register(self)

    def collect(self):
        s = self.latest
        if not s:
            return
        yield GaugeMetricFamily("rollmesh_buffer_depth_groups", "Groups waiting to be handed out", value=s["depth"])
        yield GaugeMetricFamily(
            "rollmesh_buffer_capacity_groups", "Groups held at most before Put waits", value=self.capacity_groups
        )
        yield GaugeMetricFamily(
            "rollmesh_buffer_in_flight_groups", "Groups handed out, not acked", value=s["in_flight"]
        )
        yield CounterMetricFamily("rollmesh_buffer_put_groups", "Groups stored", value=s["put"])
        yield CounterMetricFamily("rollmesh_buffer_consumed_groups", "Groups acked by the trainer", value=s["consumed"])
        yield CounterMetricFamily(
            "rollmesh_buffer_redelivered_groups", "Groups handed out again", value=s["redelivered"]
        )
        dropped = CounterMetricFamily("rollmesh_buffer_dropped_groups", "Groups dropped, by reason", labels=["reason"])
        for reason in DROP_REASONS:
            dropped.add_metric([reason], s[f"dropped_{reason}"])
        yield dropped
        yield from _domain_families(s.get("by_domain", {}))


def _domain_families(by_domain: dict[str, dict[str, int]]):
    """A buffer assembling batches by domain: each domain's depth and what became of its groups."""
    if not by_domain:
        return
    depth = GaugeMetricFamily("rollmesh_buffer_domain_depth_groups", "Groups waiting, by domain", labels=["domain"])
    counted = {
        "handed_out": CounterMetricFamily(
            "rollmesh_buffer_domain_handed_out_groups", "Groups handed out to the trainer, by domain", labels=["domain"]
        ),
        "substituted": CounterMetricFamily(
            "rollmesh_buffer_domain_substituted_groups",
            "Batch slots of a domain filled by other domains after buffer.domain_wait_s with none of its groups",
            labels=["domain"],
        ),
        "dropped_filtered": CounterMetricFamily(
            "rollmesh_buffer_domain_filtered_groups",
            "Groups kept out at Put as without learning signal (all rewards equal), by domain",
            labels=["domain"],
        ),
    }
    for d, row in sorted(by_domain.items()):
        depth.add_metric([d], row["depth"])
        for key, family in counted.items():
            family.add_metric([d], row[key])
    yield depth
    yield from counted.values()


def build_handler(buffer: SampleBuffer, metrics: BufferMetrics, max_concurrent_puts: int = 8) -> grpc.GenericRpcHandler:
    async def put(req: pb.PutRequest, ctx) -> pb.PutResponse:
        if not req.groups:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "groups: at least one encoded group is needed")
        if not 0 <= req.timeout_s < math.inf:  # NaN or infinity: a put on a full buffer waited forever
            why = f"timeout_s: must be a finite number >= 0 (0 = the default), got {req.timeout_s}"
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        try:
            results = await buffer.put_many(list(req.groups), req.timeout_s or None)
        except CodecError as e:
            metrics.puts.labels("invalid").inc()
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"groups: {e}")
        except BufferBackendError as e:
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if all(r.reason == PutRefusal.FULL for r in results):  # nothing stored: the whole call failed, retry it
            metrics.puts.labels(PutRefusal.FULL).inc(len(results))
            waited = req.timeout_s or buffer.config.put_timeout_s
            await ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"buffer full for {waited:.1f}s: nothing stored")
        for r in results:
            metrics.puts.labels("accepted" if r.accepted else r.reason).inc()
        return pb.PutResponse(results=[pb.PutResult(accepted=r.accepted, reason=r.reason) for r in results])

    async def get(req: pb.GetRequest, ctx) -> pb.GetResponse:
        t0 = time.perf_counter()
        try:
            batch = await buffer.get(req.num_groups, req.version, req.max_staleness, req.timeout_s)
        except ValueError as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except BufferBackendError as e:
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        metrics.get_seconds.observe(time.perf_counter() - t0)
        metrics.got.inc(len(batch.groups))
        now = time.time()
        for data in batch.groups:
            h = read_header(data)
            metrics.staleness.observe(max(0, req.version - h.start_version))
            metrics.age.observe(max(0.0, now - h.created_unix_s))
        return pb.GetResponse(batch_id=batch.batch_id, groups=batch.groups, num_dropped_stale=batch.dropped_stale)

    async def ack(req: pb.AckRequest, ctx) -> pb.AckResponse:
        try:
            return pb.AckResponse(num_acked=await buffer.ack(req.batch_id))
        except ValueError as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except BufferBackendError as e:
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def requeue(req: pb.RequeueRequest, ctx) -> pb.RequeueResponse:
        try:
            return pb.RequeueResponse(num_requeued=await buffer.requeue())
        except BufferBackendError as e:
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def stats(req: pb.BufferStatsRequest, ctx) -> pb.BufferStats:
        try:
            s = await buffer.stats()
        except BufferBackendError as e:
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        metrics.latest = s
        return pb.BufferStats(
            depth=s["depth"],
            in_flight=s["in_flight"],
            put_total=s["put"],
            consumed_total=s["consumed"],
            dropped_by_reason={r: s[f"dropped_{r}"] for r in DROP_REASONS},
            redelivered_total=s["redelivered"],
        )

    return unary_service(
        SERVICE,
        {
            "Put": (pb.PutRequest, put),
            "Get": (pb.GetRequest, get),
            "Ack": (pb.AckRequest, ack),
            "Requeue": (pb.RequeueRequest, requeue),
            "Stats": (pb.BufferStatsRequest, stats),
        },
        slots={"Put": asyncio.Semaphore(max_concurrent_puts)},
    )


async def _refresh(buffer: SampleBuffer, metrics: BufferMetrics, period_s: float = 1.0) -> None:
    while True:
        try:
            metrics.latest = await buffer.stats()
        except BufferBackendError as e:
            log.warning("stats refresh failed: %s", e)
        await asyncio.sleep(period_s)


async def start_buffer_service(config: BufferConfig, auth: AuthConfig | None = None):
    """Start the buffer, its gRPC server and its metrics; returns (server, buffer, refresh task)."""
    buffer = make_buffer(config)
    metrics = BufferMetrics(config.capacity_groups)
    server = await start_server(
        build_handler(buffer, metrics, config.max_concurrent_puts),
        SERVICE,
        config.host,
        config.port,
        options=[
            *BOUNDED_WINDOW_OPTIONS,
            ("grpc.max_receive_message_length", SAMPLE_BUFFER_MAX_PUT_BYTES),
            ("grpc.max_send_message_length", SAMPLE_BUFFER_MAX_MESSAGE_BYTES),
        ],
        auth=auth,
    )
    refresh = asyncio.create_task(_refresh(buffer, metrics))
    serve_metrics(metrics.registry, config.host, config.metrics_port, "SampleBuffer")
    return server, buffer, refresh


def serve(config: BufferConfig, auth: AuthConfig) -> None:
    async def start():
        server, buffer, refresh = await start_buffer_service(config, auth)
        log.info("SampleBuffer (%s) serving on %s:%d", config.backend, config.host, server.bound_port)

        async def cleanup() -> None:
            refresh.cancel()
            await buffer.close()

        return server, cleanup

    serve_until_signal(start)
