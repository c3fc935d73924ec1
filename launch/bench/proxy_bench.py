"""`rollmesh bench proxy`: latency the LLMProxy adds over calling the engine directly.

One engine process and one LLMProxy process (as deployed), 1-token generations from N
concurrent clients in this process: first straight to the engine's HTTP API, then through the
proxy's gRPC API. The added latency is the difference of the two latency distributions at the
same percentile. On a 2-core machine the engine, the proxy and the clients share the cores, so
at 64 clients the engine saturates the CPU and the proxy's CPU time per request turns into
queueing for everyone; the single-client numbers and ``proxy_cpu_ms_per_request`` show the
proxy's own cost.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

from services.processes import start_engine_process, start_service_process, stop_process

PROMPT = [1, 20, 21, 22, 23, 24, 25, 26]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _load(call, clients: int, n: int) -> tuple[list[float], float]:
    """``clients`` concurrent loops of ``n`` sequential calls; returns (latencies, wall)."""
    lat: list[float] = []

    async def worker():
        for _ in range(n):
            t = time.perf_counter()
            await call()
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return lat, time.perf_counter() - t0


async def _direct(url: str, clients: int, n: int) -> tuple[list[float], float]:
    from services.llm_proxy.server import engine_client

    client = engine_client(url, timeout_s=60)
    try:
        return await _load(lambda: client.generate(PROMPT, {"max_new_tokens": 1}), clients, n)
    finally:
        await client.close()


async def _via_proxy(address: str, clients: int, n: int) -> tuple[list[float], float]:
    from services.llm_proxy.client import ProxyClient

    client = ProxyClient(address, timeout_s=60)
    try:
        return await _load(lambda: client.generate(PROMPT, 1), clients, n)
    finally:
        await client.close()


def _start_proxy_process(engine_url: str) -> tuple[subprocess.Popen, str]:
    return start_service_process("llm-proxy", "proxy", [f"engine_urls=[{engine_url}]", "metrics_port=0"])


def _uv(coro):
    import uvloop

    return uvloop.run(coro)


def run(model_path: str, clients: int = 64, requests_per_client: int = 20) -> dict:
    engine, url = start_engine_process(model_path)
    proxy = None
    try:
        proxy, address = _start_proxy_process(url)
        _uv(_direct(url, clients, 2))  # warm-up both paths
        _uv(_via_proxy(address, clients, 2))
        direct, _ = _uv(_direct(url, clients, requests_per_client))
        cpu0 = _cpu_s(proxy.pid)
        proxied, wall = _uv(_via_proxy(address, clients, requests_per_client))
        cpu_per_request = (_cpu_s(proxy.pid) - cpu0) / len(proxied)
        single_direct, _ = _uv(_direct(url, 1, 200))
        single_proxied, _ = _uv(_via_proxy(address, 1, 200))
    finally:
        if proxy is not None:
            stop_process(proxy)
        stop_process(engine)
    ms = 1000.0
    return {
        "clients": clients,
        "requests": len(proxied),
        "direct_p50_ms": round(_pct(direct, 0.5) * ms, 3),
        "direct_p99_ms": round(_pct(direct, 0.99) * ms, 3),
        "proxy_p50_ms": round(_pct(proxied, 0.5) * ms, 3),
        "proxy_p99_ms": round(_pct(proxied, 0.99) * ms, 3),
        "proxy_cpu_ms_per_request": round(cpu_per_request * ms, 3),
        "single_client_added_p50_ms": round((_pct(single_proxied, 0.5) - _pct(single_direct, 0.5)) * ms, 3),
        "single_client_added_p99_ms": round((_pct(single_proxied, 0.99) - _pct(single_direct, 0.99)) * ms, 3),
        "proxy_added_p50_ms": round((_pct(proxied, 0.5) - _pct(direct, 0.5)) * ms, 3),
        "proxy_added_p99_ms": round((_pct(proxied, 0.99) - _pct(direct, 0.99)) * ms, 3),
        "requests_per_s": round(len(proxied) / wall, 1),
    }
