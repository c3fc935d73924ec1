"""The SampleBuffer gRPC service over a real redis-server, and its Prometheus metrics."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import httpx
import pytest

from rollout.ports import TransientError
from sample_buffer.config import BufferConfig
from services.pb.rollmesh.v1 import sample_buffer_pb2 as pb
from services.processes import free_port
from services.sample_buffer.client import BufferClient, PutBatcher
from services.sample_buffer.server import start_buffer_service
from tests.sample_buffer.helpers import make_group


def run(scenario, redis_url: str, **kw):
    async def main():
        cfg = BufferConfig(
            backend="redis",
            redis_url=redis_url,
            key_prefix=f"svc:{uuid.uuid4().hex[:8]}",
            port=0,
            metrics_port=kw.pop("metrics_port", 0),
            **kw,
        )
        server, buffer, refresh = await start_buffer_service(cfg)
        client = BufferClient(f"127.0.0.1:{server.bound_port}")
        try:
            return await scenario(client)
        finally:
            refresh.cancel()
            await client.close()
            await server.stop(0)
            await buffer.close()

    return asyncio.run(main())


def test_put_get_requeue_ack_stats_over_grpc(redis_server):
    async def scenario(client):
        batcher = PutBatcher(client, max_groups=4)
        results = await asyncio.gather(*(batcher.put(make_group(f"s{i}", version=2)) for i in range(6)))
        flat = await client.put(make_group("flat", rewards=(1.0, 1.0)))
        stale = await client.put(make_group("old", version=0))
        dead = await client.get(10, version=3, max_staleness=1, timeout_s=1)  # a consumer that died with it
        requeued = await client.requeue()
        batch = await client.get(10, version=3, max_staleness=1, timeout_s=1)
        acked = await client.ack(batch.batch_id)
        return results, flat, stale, dead, requeued, batch, acked, await client.stats()

    results, flat, stale, dead, requeued, batch, acked, stats = run(scenario, redis_server.url)
    assert all(r.accepted for r in results) and not flat.accepted and flat.reason == "filtered"
    assert stale.accepted
    assert sorted(g.group_id for g in batch.decode()) == sorted(f"s{i}" for i in range(6))
    assert requeued == len(dead.groups) == 6 and stats.redelivered_total == 6 and stats.in_flight == 0
    assert acked == 6
    assert stats.put_total == 7 and stats.consumed_total == 6 and stats.depth == 0
    assert dict(stats.dropped_by_reason) == {"stale": 1, "filtered": 1, "capacity": 0, "corrupt": 0}


def test_bad_requests_are_invalid_argument_and_full_is_resource_exhausted(redis_server):
    async def scenario(client):
        codes = {}
        for name, call in {
            "corrupt": client.stub.Put(pb.PutRequest(groups=[b"\x01\x00\x00"]), timeout=10),
            "empty": client.stub.Put(pb.PutRequest(), timeout=10),
            "num_groups": client.stub.Get(pb.GetRequest(num_groups=0), timeout=10),
            "staleness": client.stub.Get(pb.GetRequest(num_groups=1, max_staleness=-1), timeout=10),
            "batch_id": client.stub.Ack(pb.AckRequest(), timeout=10),
        }.items():
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
            codes[name] = (e.value.code(), e.value.details())
        await client.put(make_group("a"))
        with pytest.raises(TransientError) as e:  # nothing stored: worth another try
            await client.put(make_group("b"), timeout_s=0.1)
        codes["full"] = (e.value.code, str(e.value))
        still = await client.get(1, 0, 0, timeout_s=1)
        return codes, still

    codes, still = run(scenario, redis_server.url, capacity_groups=1)
    for name in ("corrupt", "empty", "num_groups", "staleness", "batch_id"):
        assert codes[name][0] == grpc.StatusCode.INVALID_ARGUMENT, (name, codes[name])
    assert "groups:" in codes["corrupt"][1] and "max_staleness" in codes["staleness"][1]
    assert codes["full"][0] == "RESOURCE_EXHAUSTED" and "nothing stored" in codes["full"][1]
    assert [g.group_id for g in still.decode()] == ["a"]


def test_metrics_report_depth_drops_and_staleness(redis_server):
    port = free_port()

    async def scenario(client):
        await client.put(make_group("x", version=4))
        await client.put(make_group("y", rewards=(0.0, 0.0)))
        batch = await client.get(1, version=6, max_staleness=3, timeout_s=1)
        await client.stats()  # refreshes the exported counters
        text = await asyncio.to_thread(lambda: httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)
        return batch, text

    batch, text = run(scenario, redis_server.url, metrics_port=port)
    assert len(batch.groups) == 1
    assert 'rollmesh_buffer_dropped_groups_total{reason="filtered"} 1.0' in text
    assert "rollmesh_buffer_in_flight_groups 1.0" in text
    assert 'rollmesh_buffer_staleness_versions_bucket{le="2.0"} 1.0' in text
    assert 'rollmesh_buffer_staleness_versions_bucket{le="1.0"} 0.0' in text
    assert "rollmesh_buffer_age_seconds_count 1.0" in text
