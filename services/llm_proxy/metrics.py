"""The LLMProxy's Prometheus metrics: calls and tokens by engine, latencies, weight updates and their
failures by cause, and gauges read at scrape time (engines, the gate, shared runs' lanes)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rollout.proxy import UPDATE_FAILURE_CAUSES, LLMProxy
from sample_buffer.trajectory import FinishReason
from services.metrics import SLOW_BUCKETS_S, histogram, init_labels


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
        yield GaugeMetricFamily("rollmesh_proxy_in_flight_requests", "Generate calls in flight", value=len(p.in_flight))
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
