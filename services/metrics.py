"""What every service's Prometheus metrics share: bucket layouts, the /metrics server, helpers.

Conventions (checked by ``promtool check metrics`` in the tests): every name starts with
``rollmesh_<service>_``, carries its unit (``_seconds``, ``_bytes``, ``_tokens``, ``_groups``,
``_versions``), counters end in ``_total`` (prometheus-client adds it), and every metric has a
HELP text. Labelled counters are created with all their known label values up front so a
dashboard or an alert sees a 0 rather than no series at all.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Histogram, start_http_server

log = logging.getLogger(__name__)

# Request latencies: from a 1-token answer on a warm engine to a long agentic generation.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Slow operations: a training step, a weight update, an environment step against a sandbox.
SLOW_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# Generated tokens of one trajectory: a one-token answer to a long agentic episode.
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
# Staleness is a small integer (bounded by async_ratio); one bucket per version near the bound.
VERSION_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
# Sample age: how long a finished group waited before training.
AGE_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


def serve_metrics(registry: CollectorRegistry, host: str, port: int, service: str) -> None:
    """Expose ``registry`` on ``http://host:port/metrics`` (a daemon thread); port 0 = disabled."""
    if not port:
        return
    from services.auth import RefusedCollector

    registry.register(RefusedCollector())
    start_http_server(port, addr=host, registry=registry)
    log.info("%s metrics on http://%s:%d/metrics", service, host, port)


def init_labels(metric, *values: str) -> None:
    """Create a labelled metric's children so each exports 0 before its first event."""
    for v in values:
        metric.labels(v)


def histogram(registry: CollectorRegistry, name: str, doc: str, buckets=LATENCY_BUCKETS_S, labels=()) -> Histogram:
    return Histogram(name, doc, list(labels), buckets=buckets, registry=registry)
