"""The ``http_buckets`` and ``ipc`` weight transports over real engine processes, the LLMProxy and
the controller: every engine ends at the trainer's weights, an engine that dies midway rolls the
update back, and buckets out of order are refused. (``collective``: test_collective_weights.py.)"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
import torch
from safetensors.torch import save

from rollout.engines.sglang.client import EngineRejected
from services.auth import AuthConfig, http_headers
from services.llm_proxy.server import engine_client
from services.weight_transports.http_buckets import BucketPublisher
from tests.services.mesh import local_mesh
from trainer.config import TrainerConfig, TrainLoopConfig
from trainer.engine import TrainEngine
from trainer.loop import TrainLoop


def _perturbed_trainer(model_path: str) -> TrainEngine:
    """A trainer at version 1 whose weights differ from the engines' (as after a step)."""
    engine = TrainEngine(TrainerConfig(model_path=model_path, lr=1e-3))
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(0.01)
    engine.version = 1
    return engine


def _loop(mesh, tmp_path, engine, publisher) -> TrainLoop:
    cfg = TrainLoopConfig(steps=1, run_dir=str(tmp_path / "run"), publish_timeout_s=20)
    return TrainLoop(
        cfg,
        engine,
        source=mesh.buffer_client,
        control=mesh.controller_client,
        publisher=publisher,
        groups_per_step=1,
        max_staleness=1,
    )


async def _engine_state(url: str) -> tuple[str, str]:
    async with httpx.AsyncClient(base_url=url, timeout=10, headers=http_headers(AuthConfig())) as c:
        body = (await c.get("/get_weight_version")).json()
    return body["weight_version"], body["checksum"]


def test_http_buckets_move_every_engine_to_the_trainer_weights(make_engine_process, tiny_model, tmp_path, monkeypatch):
    # Pieces of 64 KiB: each 1 MiB bucket reaches the proxy as 16 messages, joined there.
    monkeypatch.setattr("services.llm_proxy.client.WEIGHT_CHUNK_BYTES", 64 << 10)
    urls = [make_engine_process()[1], make_engine_process()[1]]

    async def main():
        async with local_mesh(urls, tiny_model, async_ratio=1, groups_per_step=1) as mesh:
            before = [await _engine_state(u) for u in urls]
            publisher = BucketPublisher(mesh.proxy_client, tmp_path / "run", bucket_mb=1)
            loop = _loop(mesh, tmp_path, _perturbed_trainer(tiny_model), publisher)
            ok = await loop.publish()
            after = [await _engine_state(u) for u in urls]
            # The restore point is the same weights: a disk load of it gives the same checksum.
            restore = await engine_client(urls[0]).update_weights_from_disk(str(tmp_path / "run/weights/v1"), 1)
            out = await mesh.proxy_client.generate([1, 2, 3], 4, ignore_eos=True)
            return ok, before, after, restore, out, mesh.controller.version, publisher

    ok, before, after, restore, out, version, publisher = asyncio.run(main())
    assert ok and version == 1
    assert [v for v, _ in after] == ["1", "1"] and after[0][1] == after[1][1] != before[0][1]
    assert restore["checksum"] == after[0][1]
    assert set(out.token_versions) == {1}
    assert publisher._buckets == []  # the bytes are not kept once sent


class _KillingProxyClient:
    """The trainer's proxy client, killing one engine process just before the final bucket: the
    other engine applies the new version, this one never answers."""

    def __init__(self, client, victim) -> None:
        self.client, self.victim, self.buckets = client, victim, 0

    async def update_weights_bucket(self, version, index, data, final, *args, **kwargs):
        self.buckets += 1
        if final:
            self.victim.kill()
            self.victim.wait(10)
        return await self.client.update_weights_bucket(version, index, data, final, *args, **kwargs)


@pytest.mark.parametrize("transport", ["http_buckets", "ipc"])
def test_an_engine_dying_mid_transfer_rolls_the_update_back(transport, make_engine_process, tiny_model, tmp_path):
    from services.weight_transports.ipc import IpcPublisher

    kind = BucketPublisher if transport == "http_buckets" else IpcPublisher
    survivor, (victim, victim_url) = make_engine_process()[1], make_engine_process()
    urls = [survivor, victim_url]

    async def main():
        async with local_mesh(urls, tiny_model, async_ratio=1, groups_per_step=1) as mesh:
            before = await _engine_state(survivor)
            killer = _KillingProxyClient(mesh.proxy_client, victim)
            engine = _perturbed_trainer(tiny_model)
            ok = await _loop(mesh, tmp_path, engine, kind(killer, tmp_path / "run", bucket_mb=1)).publish()
            rolled_back = await _engine_state(survivor)  # it had applied version 1
            out = await mesh.proxy_client.generate([1, 2, 3], 4, ignore_eos=True)  # generation goes on, at version 0
            # The next update goes through once the dead engine is out of rotation.
            mesh.proxy.router.engines[1].healthy = False
            again = await _loop(
                mesh, tmp_path, engine, kind(mesh.proxy_client, tmp_path / "run", bucket_mb=1)
            ).publish()
            return ok, before, rolled_back, out, again, mesh, await _engine_state(survivor), killer.buckets

    ok, before, rolled_back, out, again, mesh, final, buckets = asyncio.run(main())
    assert buckets >= 3 and not ok and mesh.controller.counters["updates_aborted"] == 1
    assert rolled_back == before and out.weight_version == 0 and len(out.output_ids) == 4
    assert again and mesh.controller.version == 1 and final[0] == "1" and final[1] != before[1]


def test_buckets_out_of_order_are_refused_and_the_proxy_keeps_serving(engine_url, tiny_model):
    state = TrainEngine(TrainerConfig(model_path=tiny_model)).full_weights()
    data = save({k: v.contiguous() for k, v in state.items()})

    async def main():
        async with local_mesh(engine_url, tiny_model) as mesh:
            errors = []
            for args in ((7, 1, data, False), (7, 0, data, True)):  # no bucket 0; no restore path
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await mesh.proxy_client.update_weights_bucket(*args)
                errors.append((e.value.code(), e.value.details()))
            out = await mesh.proxy_client.generate([1, 2, 3], 2, ignore_eos=True)
            return errors, out

    errors, out = asyncio.run(main())
    assert errors[0][0] == grpc.StatusCode.INVALID_ARGUMENT and errors[0][1].startswith("index:")
    assert errors[1][0] == grpc.StatusCode.INVALID_ARGUMENT and errors[1][1].startswith("restore_path:")
    assert len(out.output_ids) == 2


def test_a_bucket_over_the_limit_is_refused_as_its_pieces_pass_it(engine_url, tiny_model, monkeypatch):
    """Every message the proxy receives is small (PROXY_MAX_MESSAGE_BYTES); a bucket's pieces are
    counted as they arrive and refused once past MAX_WEIGHT_BUCKET_MB, before the rest is read."""
    from services.pb.rollmesh.v1 import llm_proxy_pb2 as pb
    from services.wire_limits import PROXY_MAX_MESSAGE_BYTES

    monkeypatch.setattr("services.llm_proxy.control_handlers.MAX_WEIGHT_BUCKET_MB", 2)
    monkeypatch.setattr("services.llm_proxy.client.WEIGHT_CHUNK_BYTES", 1 << 20)

    async def main():
        async with local_mesh(engine_url, tiny_model) as mesh:
            errors = []
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await mesh.proxy_client.update_weights_bucket(3, 0, bytes(3 << 20), False)
            errors.append(e.value)

            async def pieces():  # a later piece that carries a field of its own
                yield pb.WeightBucket(weight_version=3, index=0, safetensors=b"x")
                yield pb.WeightBucket(final=True, safetensors=b"y")

            with pytest.raises(grpc.aio.AioRpcError) as e:
                await mesh.proxy_client.stub.UpdateWeightsBucket(pieces(), timeout=10)
            errors.append(e.value)
            with pytest.raises(grpc.aio.AioRpcError) as e:  # one message over the proxy's receive limit
                await mesh.proxy_client.stub.Generate(
                    pb.GenerateRequest(input_ids=[1] * PROXY_MAX_MESSAGE_BYTES), timeout=10
                )
            errors.append(e.value)
            out = await mesh.proxy_client.generate([1, 2, 3], 2, ignore_eos=True)
            return [(e.code(), e.details()) for e in errors], out

    errors, out = asyncio.run(main())
    assert errors[0] == (grpc.StatusCode.RESOURCE_EXHAUSTED, "safetensors: a bucket is at most 2 MiB")
    assert errors[1][0] == grpc.StatusCode.INVALID_ARGUMENT and "a later piece carries more" in errors[1][1], errors[1]
    assert errors[2][0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in errors[2][1], errors[2]
    assert len(out.output_ids) == 2  # and the proxy goes on serving


def test_an_engine_applies_only_a_whole_version(make_engine_process, tiny_model):
    _, url = make_engine_process()
    state = TrainEngine(TrainerConfig(model_path=tiny_model)).full_weights()
    names = sorted(state)
    half = {n: state[n] for n in names[: len(names) // 2]}
    rest = {n: state[n] for n in names[len(names) // 2 :]}

    async def main():
        client = engine_client(url)
        try:
            with pytest.raises(EngineRejected, match="parameters not sent") as missing:
                await client.update_weights_from_tensors([half], 3)  # a bucket was lost
            # Half of version 4 staged, then an update to 5 starts: version 4's half is dropped.
            await client.update_weights_from_safetensors(save(half), 4, final=False)
            with pytest.raises(EngineRejected, match="parameters not sent"):
                await client.update_weights_from_tensors([rest], 5)
            whole = await client.update_weights_from_tensors([half, rest], 6)
            return missing.value, whole, await client.model_info()
        finally:
            await client.close()

    missing, whole, info = asyncio.run(main())
    assert missing.field == "tensors"
    assert whole["weight_version"] == 6 and info["weight_version"] == "6"


def test_ipc_hands_every_engine_the_trainer_weights_by_memory_handle(make_engine_process, tiny_model, tmp_path):
    """``ipc`` on CPU: shared-memory handles (CUDA IPC handles on a GPU), SGLang's
    /update_weights_from_tensor; the engines end at exactly the restore point's weights."""
    from services.weight_transports.ipc import IpcPublisher

    urls = [make_engine_process()[1], make_engine_process()[1]]

    async def main():
        async with local_mesh(urls, tiny_model, async_ratio=1, groups_per_step=1) as mesh:
            before = [await _engine_state(u) for u in urls]
            publisher = IpcPublisher(mesh.proxy_client, tmp_path / "run", bucket_mb=1)
            engine = _perturbed_trainer(tiny_model)
            loop = _loop(mesh, tmp_path, engine, publisher)
            ok = await loop.publish()
            after = [await _engine_state(u) for u in urls]
            restore = await engine_client(urls[0]).update_weights_from_disk(str(tmp_path / "run/weights/v1"), 1)
            with torch.no_grad():  # a second update to the same engines (its memory was once found gone)
                for p in engine.model.parameters():
                    p.add_(0.01)
            engine.version = 2
            again = await loop.publish()
            out = await mesh.proxy_client.generate([1, 2, 3], 4, ignore_eos=True)
            return ok and again, before, after, restore, out, publisher, [await _engine_state(u) for u in urls]

    ok, before, after, restore, out, publisher, second = asyncio.run(main())
    assert ok and [v for v, _ in after] == ["1", "1"] and after[0][1] == after[1][1] != before[0][1]
    assert restore["checksum"] == after[0][1] and set(out.token_versions) == {2}
    assert [v for v, _ in second] == ["2", "2"] and second[0][1] == second[1][1] != after[0][1]
    assert publisher._shared is None and publisher._buckets == []  # nothing held once the update ended


def test_a_tensor_handle_payload_runs_no_other_code(engine_url, tmp_path):
    """The engine unpickles nothing: a pickle that names any callable is refused by field, and
    nothing it names runs; a payload whose shapes are not the model's is refused before anything is
    mapped."""
    import base64
    import os
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    from rollout.engines import tensor_handles

    payload = base64.b64encode(pickle.dumps([("model.norm.weight", Evil())])).decode()
    wrong = tensor_handles.dumps([("model.norm.weight", torch.ones(3))])  # not the model's shape
    try:
        with httpx.Client(base_url=engine_url, timeout=10, headers=http_headers(AuthConfig())) as c:
            res = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [payload]})
            garbage = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["not base64!"]})
            shape = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [wrong.payload]})
            alive = c.get("/health")
    finally:
        wrong.close()
    assert res.status_code == 400 and res.json()["field"] == "serialized_named_tensors"
    assert "not a tensor-handle payload" in res.json()["message"]
    assert not marker.exists()
    assert shape.status_code == 400 and shape.json()["field"] == "tensors", shape.text
    assert "model.norm.weight" in shape.json()["message"]
    assert garbage.status_code == 400 and garbage.json()["field"] == "serialized_named_tensors"
    assert alive.status_code == 200


def test_a_lora_policy_reaches_the_engines_with_its_adapters_merged(make_engine_process, tiny_model, tmp_path):
    from rollout.engines.embedded.weights import weights_checksum
    from tests.trainer.helpers import toy_batch

    url = make_engine_process()[1]
    lora = {"rank": 4, "target_modules": ["q_proj", "v_proj"]}
    trainer = TrainEngine(TrainerConfig(model_path=tiny_model, lr=1e-2, lora=lora))
    trainer.train_step(toy_batch(seed=0))  # version 1: adapters no longer zero

    async def main():
        async with local_mesh([url], tiny_model, async_ratio=1, groups_per_step=1) as mesh:
            publisher = BucketPublisher(mesh.proxy_client, tmp_path / "run", bucket_mb=1)
            ok = await _loop(mesh, tmp_path, trainer, publisher).publish()
            return ok, await _engine_state(url)

    ok, (version, checksum) = asyncio.run(main())
    assert ok and version == "1" and checksum == weights_checksum(trainer.full_weights())
