"""The gateway's Prometheus metrics: sessions and groups by event, prompt tokens rendered and reused,
requests by route and status, sessions open and requests in flight."""

from __future__ import annotations

from collections import Counter

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rollout.agent.sessions import AgentSessions


class GatewayCollector:
    def __init__(self, sessions: AgentSessions, counts: Counter, in_flight: Counter) -> None:
        self.sessions, self.counts, self.in_flight = sessions, counts, in_flight

    def collect(self):
        c = self.sessions.counters
        events = CounterMetricFamily("rollmesh_gateway_events", "Sessions and groups by event", labels=["event"])
        for name in (
            "sessions_created",
            "sessions_ended",
            "groups_put",
            "groups_filtered",
            "groups_failed",
            "groups_empty",
            "groups_abandoned",
            "admit_refused",
            "trajectories_put",
        ):
            events.add_metric([name], c[name])
        yield events
        tokens = CounterMetricFamily("rollmesh_gateway_prompt_tokens", "Prompt tokens by origin", labels=["origin"])
        tokens.add_metric(["rendered"], c["tokens_rendered"])
        tokens.add_metric(["reused"], c["tokens_reused"])
        yield tokens
        requests = CounterMetricFamily(
            "rollmesh_gateway_requests", "Requests by route and status", labels=["route", "status"]
        )
        for (route, status), n in self.counts.items():
            requests.add_metric([route, status], n)
        yield requests
        live = GaugeMetricFamily("rollmesh_gateway_sessions_open", "Sessions not yet ended")
        live.add_metric([], sum(not s.ended for s in self.sessions.sessions.values()))
        yield live
        flight = GaugeMetricFamily("rollmesh_gateway_requests_in_flight", "Requests being served")
        flight.add_metric([], sum(self.in_flight.values()))
        yield flight
