"""The ``collective`` weight transport (SGLang's ``/init_weights_update_group`` contract, gloo on
CPU) over real engine processes, the LLMProxy and the controller: every engine ends at the
trainer's weights, checksummed; the group is kept between updates; an engine that dies
mid-transfer fails the update at once and rolls it back; bad input is refused by name."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
import torch

from rollout.engines.weight_group import bucket_checksum
from services.auth import AuthConfig, http_headers
from services.llm_proxy.server import engine_client
from services.weight_transports.collective import CollectivePublisher
from tests.services.mesh import local_mesh
from tests.services.test_weight_transports import _engine_state, _loop, _perturbed_trainer
from trainer.ports import PublishError


def _publisher(client, tmp_path) -> CollectivePublisher:
    return CollectivePublisher(client, tmp_path / "run", bucket_mb=1, backend="gloo")


def test_collective_moves_every_engine_to_the_trainer_weights_and_keeps_its_group(
    make_engine_process, tiny_model, tmp_path
):
    urls = [make_engine_process()[1], make_engine_process()[1]]

    async def main():
        async with local_mesh(urls, tiny_model, async_ratio=1, groups_per_step=1) as mesh:
            before = [await _engine_state(u) for u in urls]
            publisher = _publisher(mesh.proxy_client, tmp_path)
            engine = _perturbed_trainer(tiny_model)
            loop = _loop(mesh, tmp_path, engine, publisher)
            first = await loop.publish()
            after = [await _engine_state(u) for u in urls]
            restore = await engine_client(urls[0]).update_weights_from_disk(str(tmp_path / "run/weights/v1"), 1)
            engine.version = 2  # a second update over the same group
            second = await loop.publish()
            out = await mesh.proxy_client.generate([1, 2, 3], 4, ignore_eos=True)
            stats = await mesh.proxy_client.stats()
            return first, second, before, after, restore, out, publisher, stats

    first, second, before, after, restore, out, publisher, stats = asyncio.run(main())
    assert first and second
    assert [v for v, _ in after] == ["1", "1"] and after[0][1] == after[1][1] != before[0][1]
    assert restore["checksum"] == after[0][1]  # the broadcast weights are exactly the restore point's
    assert publisher.groups_made == 1 and publisher._buckets == []
    assert set(out.token_versions) == {2} and {e.weight_version for e in stats.engines} == {2}


class _KillingProxyClient:
    """The trainer's proxy client, killing one engine process just before bucket 1."""

    def __init__(self, client, victim) -> None:
        self.client, self.victim, self.buckets = client, victim, 0

    async def init_weights_group(self, *args, **kwargs):
        return await self.client.init_weights_group(*args, **kwargs)

    async def update_weights_distributed(self, version, index, *args, **kwargs):
        self.buckets += 1
        if index == 1:
            self.victim.kill()
            self.victim.wait(10)
        return await self.client.update_weights_distributed(version, index, *args, **kwargs)


def test_an_engine_dying_mid_broadcast_fails_the_update_at_once_and_rolls_it_back(
    make_engine_process, tiny_model, tmp_path
):
    survivor, (victim, victim_url) = make_engine_process()[1], make_engine_process()
    urls = [survivor, victim_url]

    async def main():
        async with local_mesh(urls, tiny_model, async_ratio=1, groups_per_step=1) as mesh:
            before = await _engine_state(survivor)
            killer = _KillingProxyClient(mesh.proxy_client, victim)
            engine = _perturbed_trainer(tiny_model)
            t0 = time.monotonic()
            ok = await _loop(mesh, tmp_path, engine, _publisher(killer, tmp_path)).publish()
            failed_in = time.monotonic() - t0
            rolled_back = await _engine_state(survivor)
            out = await mesh.proxy_client.generate([1, 2, 3], 4, ignore_eos=True)  # generation goes on, at version 0
            mesh.proxy.router.engines[1].healthy = False  # the dead engine is out of rotation
            publisher = _publisher(mesh.proxy_client, tmp_path)
            again = await _loop(mesh, tmp_path, engine, publisher).publish()  # a new group, of the survivor
            return ok, failed_in, before, rolled_back, out, again, mesh, await _engine_state(survivor), killer.buckets

    ok, failed_in, before, rolled_back, out, again, mesh, final, buckets = asyncio.run(main())
    assert not ok and buckets >= 2 and mesh.controller.counters["updates_aborted"] == 1
    assert failed_in < 15, f"the failed update took {failed_in:.1f} s: it waited for a timeout (20 s)"
    assert rolled_back[0] == "0" and rolled_back == before
    assert out.weight_version == 0 and len(out.output_ids) == 4
    assert again and mesh.controller.version == 1 and final[0] == "1" and final[1] != before[1]


def test_bad_collective_input_is_refused_by_name_and_everything_keeps_serving(engine_url, tiny_model, tmp_path, caplog):
    async def main():
        errors = {}
        async with httpx.AsyncClient(base_url=engine_url, timeout=10, headers=http_headers(AuthConfig())) as c:
            body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
            errors["nccl"] = (await c.post("/init_weights_update_group", json=body)).json()  # SGLang's default
            errors["rank"] = (
                await c.post("/init_weights_update_group", json={**body, "backend": "gloo", "rank_offset": 2})
            ).json()
            errors["no_group"] = (
                await c.post(
                    "/update_weights_from_distributed", json={"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}
                )
            ).json()
        async with local_mesh(engine_url, tiny_model) as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as no_group:
                await mesh.proxy_client.update_weights_distributed(1, 0, [("x", "float32", [1])], True, "r")
            with pytest.raises(grpc.aio.AioRpcError) as no_result:  # an adapter update's result unchecked
                await mesh.proxy_client.update_weights_distributed(
                    1, 0, [("x.lora_A", "float32", [1, 1])], True, "r", adapter=True
                )
            errors["no_result"] = (no_result.value.code(), no_result.value.details())
            with pytest.raises(grpc.aio.AioRpcError) as bad_backend:
                await mesh.proxy_client.init_weights_group("127.0.0.1", 1234, "g", "mpi")
            # A host the config does not allow: the engines are never pointed at it.
            with pytest.raises(grpc.aio.AioRpcError) as elsewhere:
                await mesh.proxy_client.init_weights_group("203.0.113.7", 1234, "g", "gloo")
            errors["elsewhere"] = (elsewhere.value.code(), elsewhere.value.details())
            # A bucket naming a tensor the model lacks: refused by the engine, the update fails, the
            # trainer's broadcast is not left waiting.
            publisher = _publisher(mesh.proxy_client, tmp_path)
            engine = _perturbed_trainer(tiny_model)
            publisher.export(engine, 1)
            tensors, _ = publisher._buckets[0]
            tensors["model.no_such_weight"] = tensors.pop(next(iter(tensors)))
            t0 = time.monotonic()
            with pytest.raises(Exception, match="no_such_weight") as refused:
                await publisher.load(1, 20)
            took = time.monotonic() - t0
            # Adapter factors for a layer the model lacks: refused before they are received, and the
            # publisher broadcasts every weight instead (a new group: the refusal closed the first).
            factors = {
                "model.no_such.lora_A": torch.ones(2, 128),
                "model.no_such.lora_B": torch.ones(128, 2),
                "model.no_such.lora_scaling": torch.tensor(2.0),
            }
            adapted = CollectivePublisher(mesh.proxy_client, tmp_path / "run", bucket_mb=1, adapter_dtype="float32")
            adapted._buckets = [(factors, bucket_checksum(factors))]
            adapted._result, adapted._state = "0" * 16, engine.full_weights()
            adapted.restore.export(engine, 2, adapted._state)  # the directory an engine that rejoins loads
            try:
                await adapted.load(2, 20)
                version, _ = await _engine_state(engine_url)
            finally:  # the session's engine: back to the tiny model's weights, as other tests find it
                adapted.close()
                await engine_client(engine_url).update_weights_from_disk(tiny_model, 0)
            out = await mesh.proxy_client.generate([1, 2, 3], 2, ignore_eos=True)
        return errors, no_group.value, bad_backend.value, refused.value, took, out, publisher, adapted, version

    errors, no_group, bad_backend, refused, took, out, publisher, adapted, version = asyncio.run(main())
    assert adapted.delta_fallbacks == 1 and adapted.groups_made == 2 and version == "2"
    assert "'model.no_such' is not a linear layer" in caplog.text  # the engine's reason, passed on
    code, details = errors["no_result"]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("result_checksum:")
    assert errors["nccl"]["field"] == "backend" and "gloo" in errors["nccl"]["message"]
    code, details = errors["elsewhere"]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("master_address: '203.0.113.7' is not")
    assert errors["rank"]["field"] == "rank_offset"
    assert errors["no_group"]["field"] == "group_name"
    assert no_group.code() == grpc.StatusCode.INVALID_ARGUMENT and no_group.details().startswith("group_name:")
    assert bad_backend.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_backend.details().startswith("backend:")
    assert took < 15 and len(out.output_ids) == 2
    assert isinstance(refused, PublishError) and "tensors" in str(refused)  # the engine's field, passed on
    assert publisher.group is None  # closed: the trainer's blocked broadcast ends, the next update re-forms it
