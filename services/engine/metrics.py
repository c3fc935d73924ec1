"""The embedded engine's Prometheus metrics: finished requests, tokens, latencies, and its load."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from rollout.engines.contract import GenerateOutput
from services.metrics import histogram, init_labels

if TYPE_CHECKING:
    from rollout.engines.embedded.engine import EmbeddedEngine


class EngineMetrics:
    def __init__(self, engine: EmbeddedEngine) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "rollmesh_engine_requests", "Finished generate requests, by finish reason", ["finish"], registry=r
        )
        init_labels(self.requests, "stop", "length", "abort")
        self.tokens = Counter("rollmesh_engine_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("rollmesh_engine_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.ignored = Counter(
            "rollmesh_engine_ignored_fields",
            "Top-level /generate fields SGLang does not define, ignored as SGLang ignores them",
            ["field"],
            registry=r,
        )
        self.latency = histogram(r, "rollmesh_engine_generation_latency_seconds", "One generate request, end to end")
        self.ttft = histogram(r, "rollmesh_engine_time_to_first_token_seconds", "Submit to first generated token")
        self.queue = histogram(r, "rollmesh_engine_queue_time_seconds", "Submit to admission into the running batch")
        for name, doc, key in [
            ("rollmesh_engine_running_requests", "Requests in the running batch", "num_running"),
            ("rollmesh_engine_waiting_requests", "Requests waiting for admission", "num_waiting"),
            ("rollmesh_engine_paused", "1 while generation is paused", "paused"),
            ("rollmesh_engine_weight_version", "Weight version being served", "weight_version"),
        ]:
            Gauge(name, doc, registry=r).set_function(lambda key=key: float(engine.load()[key]))

    def observe(self, out: GenerateOutput) -> None:
        self.requests.labels(out.finish_reason["type"]).inc()
        self.tokens.inc(len(out.output_ids))
        self.prompt_tokens.inc(out.prompt_tokens)
        self.latency.observe(out.e2e_latency_s)
        self.queue.observe(out.queue_time_s)
        if out.output_ids:
            self.ttft.observe(out.ttft_s)
