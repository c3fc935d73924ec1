"""`rollmesh bench buffer`: groups through the gRPC SampleBuffer backed by Redis, vs raw Redis.

A local redis-server (AOF, fsync on every write: the durable configuration) and the buffer
service in its own process; in this process, concurrent producers put pre-encoded groups
through a ``PutBatcher`` (as EnvManager workers do) while one consumer gets batches of 32 and
acks them, as a trainer would. The raw figure is SET+GET of a value
of the same size from Python with the same concurrency: the ceiling the service is held to.
"""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from sample_buffer.codec import encode_group
from sample_buffer.trajectory import Group, Trajectory
from services.processes import RedisServer, start_service_process, stop_process

PRODUCERS = 64  # concurrent episode workers putting groups
GET_BATCH = 32


def make_payloads(
    n_distinct: int,
    group_size: int,
    tokens: int,
    routing_ids: int = 0,
    experts: int = 128,
    images: tuple[bytes, ...] = (),
) -> list[bytes]:
    """Encoded groups; ``routing_ids`` > 0: each trajectory carries MoE routing of that many ids per
    token (layers × top_k, e.g. Qwen3-30B-A3B's 48 × 8) among ``experts``, as routing replay records;
    ``images``: every trajectory's prompt shows them, and the group carries each once."""
    from sample_buffer.vision import content_hash

    hashes = tuple(content_hash(x) for x in images)
    rng = np.random.default_rng(0)
    prompt = tokens // 4
    out = []
    for g in range(n_distinct):
        trajs = [
            Trajectory(
                trajectory_id=f"b{g}/{i}",
                group_id=f"b{g}",
                prompt_id=f"p{g}",
                token_ids=rng.integers(0, 150_000, tokens),
                loss_mask=np.r_[np.zeros(prompt), np.ones(tokens - prompt)],
                behavior_logprobs=-rng.random(tokens - prompt),
                token_versions=np.zeros(tokens - prompt),
                reward=float(i % 2),
                start_version=0,
                routed_experts=rng.integers(
                    0, experts, (tokens - 1, routing_ids), dtype=np.uint8 if experts <= 256 else np.uint16
                )
                if routing_ids
                else None,
                images=hashes,
            )
            for i in range(group_size)
        ]
        out.append(encode_group(Group(f"b{g}", f"p{g}", trajs, images=dict(zip(hashes, images)))))
    return out


def _start_service(redis_url: str) -> tuple[subprocess.Popen, str]:
    overrides = [
        "backend=redis",
        f"redis_url={redis_url}",
        "metrics_port=0",
        "key_prefix=bench",
        "capacity_groups=4096",
    ]
    return start_service_process("sample-buffer", "buffer", overrides)


async def _through_service(address: str, payloads: list[bytes], total: int) -> tuple[float, list[float]]:
    from services.sample_buffer.client import BufferClient, PutBatcher

    client = BufferClient(address)
    batcher = PutBatcher(client)
    latencies: list[float] = []

    async def produce(k: int) -> None:
        for i in range(k, total, PRODUCERS):
            await batcher.put(payloads[i % len(payloads)], timeout_s=60)

    async def consume() -> None:
        done = 0
        while done < total:
            t = time.perf_counter()
            batch = await client.get(GET_BATCH, version=0, max_staleness=0, timeout_s=1.0)
            latencies.append(time.perf_counter() - t)
            if batch.batch_id:
                done += await client.ack(batch.batch_id)

    t0 = time.perf_counter()
    await asyncio.gather(consume(), *(produce(k) for k in range(PRODUCERS)))
    wall = time.perf_counter() - t0
    await client.close()
    return wall, latencies


async def _raw_redis(url: str, value: bytes, ops: int) -> float:
    import redis.asyncio as aioredis

    r = aioredis.from_url(url)

    async def worker(k: int) -> None:
        for i in range(k, ops // 2, PRODUCERS):
            await r.set(f"raw:{i % 256}", value)
            await r.get(f"raw:{i % 256}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(PRODUCERS)))
    wall = time.perf_counter() - t0
    await r.delete(*[f"raw:{i}" for i in range(256)])
    await r.aclose()
    return ops / wall


def run(
    groups: int = 20_000, group_size: int = 8, tokens: int = 512, routing_ids: int = 0, images: tuple[bytes, ...] = ()
) -> dict:
    import uvloop

    t = time.perf_counter()
    payloads = make_payloads(64, group_size, tokens, routing_ids, images=images)
    encode_ms = (time.perf_counter() - t) / 64 * 1000
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp)).start()
        service = None
        try:
            service, address = _start_service(server.url)
            uvloop.run(_through_service(address, payloads, min(groups, 200)))  # warm-up
            wall, lat = uvloop.run(_through_service(address, payloads, groups))
            raw_ops = uvloop.run(_raw_redis(server.url, payloads[0], min(groups, 10_000)))
        finally:
            if service is not None:
                stop_process(service)
            server.stop()
    groups_per_s = groups / wall
    lat.sort()
    return {
        "groups": groups,
        "payload_bytes": len(payloads[0]),
        "encode_ms_per_group": round(encode_ms, 3),
        "wall_s": round(wall, 2),
        "groups_per_s": round(groups_per_s, 1),
        "trajectories_per_s": round(groups_per_s * group_size, 1),
        "mb_per_s": round(groups_per_s * len(payloads[0]) / 1e6, 1),
        "raw_redis_ops_per_s": round(raw_ops, 1),
        "ratio_to_raw": round(groups_per_s / raw_ops, 3),
        "p99_get_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000, 2),
    }
