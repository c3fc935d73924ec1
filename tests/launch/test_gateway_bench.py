"""`rollmesh bench gateway` at a small scale: every service its own process, agents through the gateway."""

from __future__ import annotations

from launch.bench.gateway_bench import run


def test_the_gateway_bench_reports_errors_latency_and_reuse(tiny_model):
    out = run(tiny_model, clients=4, duration_s=2.0, turns=3, max_tokens=2, progress=lambda _: None)
    assert out["errors"] == 0 and out["sessions"] >= 4 and out["requests"] >= 3 * 4
    # Turns 2 and 3 of every session reuse what turn 1 rendered and generated.
    assert out["tokens_reused"] > out["tokens_rendered"] * 0.5 and 0 < out["reused_share"] < 1
    for key in ("direct_p50_ms", "gateway_p99_ms", "added_p50_ms", "single_client_added_p50_ms", "requests_per_s"):
        assert isinstance(out[key], float), key
