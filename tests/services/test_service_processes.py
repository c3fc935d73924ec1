"""The services as their own processes: `rollmesh serve ...`, metrics, graceful SIGTERM."""

from __future__ import annotations

import subprocess
import sys

import grpc
import httpx

from services.auth import AuthConfig
from services.processes import free_port, wait_grpc_healthy

TOKEN = [("authorization", AuthConfig().bearer())]


def test_proxy_process_serves_metrics_and_stops_on_sigterm(engine_url):
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "launch.cli", "serve", "llm-proxy", "-c", "examples/inference.yaml"]
    cmd += ["--set", f"proxy.engine_urls=[{engine_url}]", "--set", f"proxy.port={port}"]
    cmd += ["--set", f"proxy.metrics_port={metrics_port}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_grpc_healthy(f"127.0.0.1:{port}", 60, proc)
        from services.pb.rollmesh.v1 import llm_proxy_pb2 as pb
        from services.pb.rollmesh.v1 import llm_proxy_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            res = llm_proxy_pb2_grpc.LLMProxyStub(ch).Generate(
                pb.GenerateRequest(input_ids=[1, 2], sampling_params=pb.SamplingParams(max_new_tokens=3)),
                timeout=30,
                metadata=TOKEN,
            )
        assert len(res.output_ids) >= 1
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        for name in (
            "rollmesh_proxy_requests_total",
            "rollmesh_proxy_generate_latency_seconds_bucket",
            "rollmesh_proxy_engines_in_rotation 1.0",
            "rollmesh_proxy_suspended 0.0",
        ):
            assert name in text, name
        proc.terminate()
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_engine_process_stops_on_sigterm(make_engine_process):
    proc, url = make_engine_process()
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    proc.terminate()
    assert proc.wait(15) == 0


def test_buffer_process_serves_and_stops_on_sigterm(redis_server):
    from services.processes import start_service_process

    proc, address = start_service_process(
        "sample-buffer",
        "buffer",
        ["backend=redis", f"redis_url={redis_server.url}", "key_prefix=proc-test", "metrics_port=0"],
    )
    try:
        from services.pb.rollmesh.v1 import sample_buffer_pb2 as pb
        from services.pb.rollmesh.v1 import sample_buffer_pb2_grpc

        with grpc.insecure_channel(address) as ch:
            stats = sample_buffer_pb2_grpc.SampleBufferStub(ch).Stats(
                pb.BufferStatsRequest(), timeout=10, metadata=TOKEN
            )
        assert stats.depth == 0 and "stale" in stats.dropped_by_reason
        proc.terminate()
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
