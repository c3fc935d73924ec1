"""``rollmesh bench providers``: what the wire to an environment provider costs.

Provider processes (``rollmesh serve env-provider``) host a trivial environment (the simulated
one with no latency: a step answers at once), so what is measured is the protocol and the
service around it. Episodes run through the EnvManager's own client path (``ProviderPool`` and
``RemoteEnv`` over the gRPC, REST and OpenEnv WebSocket clients), ``concurrency`` at a time, each
stepping until the cell's time is up. Every provider serves both protocols, so the same
processes serve every cell.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from launch.bench import BadOption
from rollout.envs.remote import PROTOCOLS, RemoteEnv, RemoteEnvConfig
from services.auth import AuthConfig
from services.env_provider.clients import build_pool
from services.processes import start_provider_process, stop_process


def _trivial_env() -> list[str]:
    rows = Path(tempfile.mkdtemp(prefix="rollmesh-bench-providers-")) / "rows.jsonl"
    rows.write_text('{"prompt": "step", "answer": "0"}\n')
    return [f"dataset_path={rows}", "env.latency_median_s=0", "env.turns=1000000000", "max_sessions=4096"]


async def _cell(protocol: str, addresses: list[str], concurrency: int, seconds: float) -> dict:
    pool = build_pool(RemoteEnvConfig(protocol=protocol, addresses=addresses, call_timeout_s=30), AuthConfig())
    latencies: list[float] = []
    end = time.monotonic() + seconds

    async def episode(i: int) -> None:
        env = RemoteEnv(pool, f"bench-{protocol}-{len(addresses)}-{i}")
        await env.reset(i)
        try:
            while time.monotonic() < end:
                t0 = time.perf_counter()
                await env.step("a")
                latencies.append(time.perf_counter() - t0)
        finally:
            await env.close()

    try:
        t0 = time.monotonic()
        await asyncio.gather(*(episode(i) for i in range(concurrency)))
        wall = time.monotonic() - t0
    finally:
        await pool.aclose()
    latencies.sort()
    return {
        "steps_per_s": round(len(latencies) / wall, 1),
        "p50_ms": round(statistics.median(latencies) * 1e3, 2),
        "p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1e3, 2),
        "steps": len(latencies),
    }


def run(providers: list[int], protocols: list[str], concurrency: int, seconds: float, progress=print) -> dict:
    if not providers or min(providers) < 1 or concurrency < 1 or seconds <= 0:
        raise BadOption("--providers: each >= 1; --concurrency >= 1; --seconds > 0")
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if unknown:
        raise BadOption(f"--protocol: {unknown[0]!r} is not one of {list(PROTOCOLS)}")
    overrides = _trivial_env()
    progress(f"starting {max(providers)} provider process(es)")
    procs = []
    try:
        for _ in range(max(providers)):
            procs.append(start_provider_process("sim", overrides))
        out: dict = {"concurrency": concurrency, "seconds_per_cell": seconds}
        for protocol in protocols:
            for n in providers:
                addresses = [grpc if protocol == "grpc" else url for _, grpc, url in procs[:n]]
                r = asyncio.run(_cell(protocol, addresses, concurrency, seconds))
                progress(
                    f"{protocol:8s} {n:3d} provider(s): {r['steps_per_s']:8.1f} steps/s  p50 {r['p50_ms']:.2f} ms"
                    f"  p99 {r['p99_ms']:.2f} ms"
                )
                for k in ("steps_per_s", "p50_ms", "p99_ms"):
                    out[f"{protocol}_{n}_{k}"] = r[k]
        for n in providers:
            if "grpc" in protocols and "http" in protocols:
                ratio = out[f"grpc_{n}_steps_per_s"] / out[f"http_{n}_steps_per_s"]
                out[f"grpc_vs_http_steps_ratio_{n}"] = round(ratio, 2)
        return out
    finally:
        for proc, _, _ in procs:
            stop_process(proc)
