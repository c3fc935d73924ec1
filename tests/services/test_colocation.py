"""Colocated engines (``devices.placement: colocated``): while a step trains, generation is suspended
and every engine has given its memory back; after it, the engines take it back, the new weights
load and generation goes on; a trainer that never comes back is covered by the proxy's lease; an
engine refuses a release that would lose running requests, and bad input by field."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from services.auth import AuthConfig, http_headers
from services.trainer.colocation import ProxyMemory
from services.weight_transports.disk import DiskPublisher
from tests.services.mesh import digit_rollout, local_mesh
from trainer.config import TrainerConfig, TrainLoopConfig
from trainer.engine import TrainEngine
from trainer.loop import TrainLoop


def _released(url: str) -> list[str]:
    with httpx.Client(base_url=url, timeout=10, headers=http_headers(AuthConfig())) as c:
        return c.get("/get_model_info").json()["memory_released"]


def test_a_colocated_step_trains_while_the_engines_are_released(make_engine_process, tiny_model, tmp_path):
    urls = [make_engine_process()[1], make_engine_process()[1]]
    seen = {}

    async def main():
        async with local_mesh(
            urls, tiny_model, {"filter_zero_variance": False}, async_ratio=1, groups_per_step=2
        ) as mesh:
            env = digit_rollout(mesh, tiny_model)
            engine = TrainEngine(TrainerConfig(model_path=tiny_model, lr=1e-3))
            train_step = engine.train_step

            def observed(batch):  # what the engines and the proxy are doing while the step trains
                seen["released"] = [_released(u) for u in urls]
                seen["suspended"] = mesh.proxy.suspended
                return train_step(batch)

            engine.train_step = observed
            cfg = TrainLoopConfig(steps=1, run_dir=str(tmp_path / "run"), get_timeout_s=60)
            loop = TrainLoop(
                cfg,
                engine,
                source=mesh.buffer_client,
                control=mesh.controller_client,
                publisher=DiskPublisher(mesh.proxy_client, cfg.run_dir),
                groups_per_step=2,
                max_staleness=1,
                memory=ProxyMemory(mesh.proxy_client, lease_s=120),
            )
            await env.start()
            await loop.join()
            metrics = await loop.step()
            after = [_released(u) for u in urls]
            out = await mesh.proxy_client.generate([1, 2, 3], 3, ignore_eos=True)
            await env.stop()
            return metrics, after, out, mesh

    metrics, after, out, mesh = asyncio.run(main())
    assert seen["released"] == [["kv_cache", "weights"]] * 2 and seen["suspended"]
    assert metrics["published"] and after == [[], []] and not mesh.proxy.suspended
    assert out.weight_version == 1 and len(out.output_ids) == 3
    assert (
        mesh.proxy.counters["memory_releases"] == 1 and mesh.proxy.control.lease is None
    )  # the update ended the lease


def test_the_lease_gives_the_engines_back_when_the_trainer_never_returns(engine_url, tiny_model):
    async def main():
        async with local_mesh(engine_url, tiny_model) as mesh:
            res = await mesh.proxy_client.release_memory(lease_s=1.0)
            during = _released(engine_url), mesh.proxy.suspended
            t0 = time.monotonic()
            out = await mesh.proxy_client.generate(
                [1, 2, 3], 2, timeout_s=30, ignore_eos=True
            )  # waits at the gate, then runs
            waited = time.monotonic() - t0
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await mesh.proxy_client.release_memory(lease_s=0)
            with pytest.raises(grpc.aio.AioRpcError) as tag:
                await mesh.proxy_client.release_memory(lease_s=5, tags=["optimizer"])
            return res, during, out, waited, bad.value, tag.value, _released(engine_url), mesh

    res, during, out, waited, bad, tag, after, mesh = asyncio.run(main())
    assert res.success and during == (["kv_cache", "weights"], True)
    assert len(out.output_ids) == 2 and 0.5 < waited < 10 and after == []
    assert mesh.proxy.counters["memory_lease_expired"] == 1 and not mesh.proxy.suspended
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and bad.details().startswith("lease_s:")
    assert tag.code() == grpc.StatusCode.INVALID_ARGUMENT and tag.details().startswith("tags:")


def test_an_engine_releases_memory_only_when_paused_and_serves_only_with_its_weights(engine_url):
    with httpx.Client(base_url=engine_url, timeout=30, headers=http_headers(AuthConfig())) as c:
        running = c.post("/release_memory_occupation", json={})
        bad_tag = c.post("/release_memory_occupation", json={"tags": ["optimizer"]})
        c.post("/pause_generation", json={"mode": "abort"})
        released = c.post("/release_memory_occupation", json={"tags": ["weights"]}).json()
        early = c.post("/continue_generation")
        resumed = c.post("/resume_memory_occupation", json={}).json()
        go = c.post("/continue_generation")
        out = c.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}).json()
    assert running.status_code == 400 and running.json()["field"] == "memory"
    assert bad_tag.status_code == 400 and bad_tag.json()["field"] == "tags"
    assert released["memory_released"] == ["weights"]
    assert early.status_code == 400 and "resume_memory_occupation" in early.json()["message"]
    assert resumed["memory_released"] == [] and go.status_code == 200 and len(out["output_ids"]) == 2
