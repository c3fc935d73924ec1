"""Delta weight updates (``http_buckets`` with ``delta: true``) over real bfloat16 engine processes,
the LLMProxy and the controller: after a first whole update only what changed travels and every
engine ends where a full load of the same version puts it; an engine that missed a version, or
holds other weights under the right number, makes the publisher send every weight instead, and
the next update is a delta again. Bad deltas sent straight to an engine are refused naming the
field, and it keeps its weights and serving."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from safetensors.torch import save

from rollout.engines import tensor_handles, weight_delta
from rollout.engines.sglang.client import EngineRejected
from services.auth import AuthConfig, http_headers
from services.llm_proxy.server import engine_client
from services.weight_transports.http_buckets import BucketPublisher
from tests.services.mesh import local_mesh
from tests.services.test_weight_transports import _engine_state, _loop, _perturbed_trainer

BF16 = ("dtype=bfloat16",)


async def _load(url: str, path, version: int) -> dict:
    client = engine_client(url)
    try:
        return await client.update_weights_from_disk(str(path), version)
    finally:
        await client.close()


def _step(trainer, scale: float = 3e-6) -> None:
    """New float32 weights, as after an optimizer step at an RL learning rate."""
    g = torch.Generator().manual_seed(trainer.version)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    trainer.version += 1


def test_deltas_move_every_engine_and_fall_back_to_every_weight(make_engine_process, tiny_model, tmp_path):
    urls = [make_engine_process(extra=BF16)[1], make_engine_process(extra=BF16)[1]]
    run = tmp_path / "run"

    async def main():
        async with local_mesh(urls, tiny_model, async_ratio=1, groups_per_step=1) as mesh:
            publisher = BucketPublisher(mesh.proxy_client, run, bucket_mb=1, delta_dtype="bfloat16")
            trainer = _perturbed_trainer(tiny_model)  # version 1
            loop = _loop(mesh, tmp_path, trainer, publisher)
            out = {"first": (await loop.publish(), dict(publisher.stats))}  # nothing known held: whole
            _step(trainer)  # version 2: a delta
            out["delta"] = (await loop.publish(), dict(publisher.stats), [await _engine_state(u) for u in urls])
            # A full load of the same version puts an engine where the delta did.
            out["reload"] = await _load(urls[0], run / "weights/v2", 2)
            # Engine 1 misses a version: it is put back on version 1's weights.
            await _load(urls[1], run / "weights/v1", 1)
            _step(trainer)  # version 3: engine 1 refuses the delta against 2, everyone gets every weight
            out["missed"] = (await loop.publish(), dict(publisher.stats), [await _engine_state(u) for u in urls])
            # Engine 0 holds version 2's weights under number 3: the delta against 3 applies, its
            # checksum is not the trainer's, it puts its weights back, and the fallback fixes it.
            await _load(urls[0], run / "weights/v2", 3)
            _step(trainer)  # version 4
            out["wrong"] = (await loop.publish(), dict(publisher.stats), [await _engine_state(u) for u in urls])
            _step(trainer)  # version 5: a delta again
            out["again"] = (await loop.publish(), dict(publisher.stats), [await _engine_state(u) for u in urls])
            out["reload5"] = await _load(urls[1], run / "weights/v5", 5)
            generated = await mesh.proxy_client.generate([1, 2, 3], 4, ignore_eos=True)
            return out, generated, mesh.controller.version

    out, generated, version = asyncio.run(main())
    ok, first = out["first"]
    full_bytes = first["weight_update_bytes"]
    assert ok and first["weight_delta_fallbacks"] == 0 and "weight_delta_changed_share" not in first
    ok, delta, states = out["delta"]
    assert ok and delta["weight_delta_fallbacks"] == 0 and 0 < delta["weight_delta_changed_share"] < 0.5
    assert delta["weight_update_bytes"] < full_bytes / 4  # float32 whole vs what changed in bfloat16
    assert states[0] == states[1] and states[0][0] == "2" and out["reload"]["checksum"] == states[0][1]
    ok, missed, states = out["missed"]
    assert ok and missed["weight_delta_fallbacks"] == 1 and missed["weight_update_bytes"] == full_bytes
    assert states[0] == states[1] and states[0][0] == "3"
    ok, wrong, states = out["wrong"]
    assert ok and wrong["weight_delta_fallbacks"] == 2 and states[0] == states[1] and states[0][0] == "4"
    ok, again, states = out["again"]
    assert ok and again["weight_delta_fallbacks"] == 2 and again["weight_update_bytes"] < full_bytes / 4
    assert states[0] == states[1] and states[0][0] == "5" and out["reload5"]["checksum"] == states[0][1]
    assert version == 5 and set(generated.token_versions) == {5}


async def _post(url: str, data: bytes, **params) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=http_headers(AuthConfig())) as c:
        return await c.post("/update_weights_from_safetensors", params=params, content=data)


def test_float32_engines_take_deltas_too(make_engine_process, tiny_model, tmp_path):
    """Where nothing converts (float32 engines, a CPU trainer) the base must still be a copy."""
    url = make_engine_process()[1]

    async def main():
        async with local_mesh([url], tiny_model, async_ratio=1, groups_per_step=1) as mesh:
            publisher = BucketPublisher(mesh.proxy_client, tmp_path / "run", bucket_mb=1, delta_dtype="float32")
            trainer = _perturbed_trainer(tiny_model)
            loop = _loop(mesh, tmp_path, trainer, publisher)
            first = await loop.publish(), dict(publisher.stats)
            _step(trainer)
            ok = await loop.publish()
            state = await _engine_state(url)  # as the delta left it ...
            reload = await _load(url, tmp_path / "run/weights/v2", 2)  # ... and as a whole load of v2 does
            return first, ok, dict(publisher.stats), state, reload

    first, ok, delta, state, reload = asyncio.run(main())
    assert first[0] and ok and delta["weight_delta_fallbacks"] == 0 and delta["weight_delta_changed_share"] > 0
    assert delta["weight_update_bytes"] <= first[1]["weight_update_bytes"] and reload["checksum"] == state[1]


def test_bad_deltas_are_refused_naming_the_field_and_the_engine_keeps_its_weights(make_engine_process):
    url = make_engine_process(extra=BF16)[1]
    one = save(
        {"model.norm.weight#index": torch.tensor([5]), "model.norm.weight#value": torch.full((1,), 3.0).bfloat16()}
    )

    async def greedy() -> list[int]:
        client = engine_client(url)
        try:
            out = await client.generate([1, 2, 3], {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        finally:
            await client.close()
        assert out.weight_version == 0
        return out.output_ids

    async def main():
        before = await _engine_state(url), await greedy()
        answers = {
            "base": await _post(url, one, weight_version=1, base_version=7, final="true", checksum="ab"),
            "no_checksum": await _post(url, one, weight_version=1, base_version=0, final="true"),
            "no_version": await _post(url, one, base_version=0, final="false"),
            "half": await _post(
                url,
                save({"model.norm.weight#index": torch.tensor([0])}),
                weight_version=1,
                base_version=0,
                final="false",
            ),
            "dtype": await _post(
                url, save({"model.norm.weight": torch.ones(64)}), weight_version=1, base_version=0, final="false"
            ),
            "sum": await _post(url, one, weight_version=1, base_version=0, final="true", checksum="0" * 16),
        }
        return before, answers, (await _engine_state(url), await greedy())

    before, answers, after = asyncio.run(main())
    for key, field in [
        ("base", "base_version"),
        ("no_checksum", "checksum"),
        ("no_version", "weight_version"),
        ("half", "tensors"),
        ("dtype", "tensors"),
        ("sum", "checksum"),
    ]:
        assert answers[key].status_code == 400, (key, answers[key].text)
        assert field in answers[key].text, (key, answers[key].text)
    assert "holds 0" in answers["base"].text and "served unchanged" in answers["sum"].text
    # The same version and the same greedy tokens: the delta with the wrong checksum was put back.
    assert after == before and len(after[1]) == 8


def test_an_engine_without_deltas_refuses_one(make_engine_process, tiny_model):
    """The simulated engine has no delta path: the request is refused, not half applied."""
    url = make_engine_process(extra=("type=sim",))[1]
    data = save(weight_delta.cast({"model.norm.weight": torch.ones(64)}, torch.bfloat16))

    async def main():
        client = engine_client(url)
        try:
            with pytest.raises(EngineRejected, match="applies no delta updates"):
                await client.update_weights_from_safetensors(data, 1, True, base_version=0, checksum="ab")
        finally:
            await client.close()

    asyncio.run(main())


def _adapter_publisher(transport: str, client, run):
    """``transport``'s publisher of a LoRA policy's factors to bfloat16 engines."""
    from services.weight_transports.collective import CollectivePublisher
    from services.weight_transports.ipc import IpcPublisher

    if transport == "collective":
        return CollectivePublisher(client, run, bucket_mb=1, backend="gloo", adapter_dtype="bfloat16")
    kind = IpcPublisher if transport == "ipc" else BucketPublisher
    return kind(client, run, bucket_mb=1, adapter_dtype="bfloat16")


@pytest.mark.parametrize("transport", ["http_buckets", "ipc", "collective"])
def test_a_lora_policy_sends_only_its_factors_and_falls_back_to_every_weight(
    transport, make_engine_process, tiny_model, tiny_model_b, tmp_path
):
    from tests.trainer.helpers import toy_batch
    from trainer.config import TrainerConfig
    from trainer.engine import TrainEngine

    urls = [make_engine_process(extra=BF16)[1], make_engine_process(extra=BF16)[1]]
    run = tmp_path / "run"
    lora = {"rank": 2, "target_modules": ["q_proj", "v_proj"]}
    trainer = TrainEngine(TrainerConfig(model_path=tiny_model, lr=1e-2, lora=lora))

    async def publish(loop) -> tuple:
        trainer.train_step(toy_batch(seed=trainer.version))
        ok = await loop.publish()
        return ok, dict(loop.publisher.stats), [await _engine_state(u) for u in urls]

    async def main():
        async with local_mesh(urls, tiny_model, async_ratio=1, groups_per_step=1) as mesh:
            loop = _loop(mesh, tmp_path, trainer, _adapter_publisher(transport, mesh.proxy_client, run))
            out = {"first": await publish(loop)}  # version 1: the factors alone
            out["reload"] = await _load(urls[0], run / "weights/v1", 1)  # the whole weights of v1
            # Engine 1 holds other weights than its base's outside the adapted layers: the result's
            # checksum is not the trainer's, it puts them back, and every weight is sent instead.
            await _load(urls[1], tiny_model_b, 1)
            out["other"] = await publish(loop)  # version 2
            out["again"] = await publish(loop)  # version 3: the factors alone again
            out["reload3"] = await _load(urls[1], run / "weights/v3", 3)
            return out, loop.publisher

    out, publisher = asyncio.run(main())
    ok, first, states = out["first"]
    assert ok and first["weight_delta_fallbacks"] == 0
    assert states[0] == states[1] and states[0][0] == "1" and out["reload"]["checksum"] == states[0][1]
    ok, other, states = out["other"]
    assert ok and other["weight_delta_fallbacks"] == 1 and other["weight_update_bytes"] > first["weight_update_bytes"]
    assert states[0] == states[1] and states[0][0] == "2"
    ok, again, states = out["again"]
    assert ok and again["weight_delta_fallbacks"] == 1 and again["weight_update_bytes"] == first["weight_update_bytes"]
    assert states[0] == states[1] and states[0][0] == "3" and out["reload3"]["checksum"] == states[0][1]
    if transport != "ipc":  # ipc's bytes are its handles': the tensors stay in shared memory
        whole = sum(f.stat().st_size for f in (run / "weights/v3").glob("*.safetensors"))
        assert first["weight_update_bytes"] < whole / 20 < whole / 2 < other["weight_update_bytes"]
    assert publisher._buckets == []  # nothing held once the update ended
    if transport == "collective":
        assert publisher.groups_made == 2  # the failed adapter update closed the first group


def test_bad_adapter_updates_are_refused_naming_the_field(make_engine_process):
    url = make_engine_process(extra=BF16)[1]
    a, b = torch.ones(2, 128), torch.ones(128, 2)  # the tiny model: 128 wide; B A changes every value
    layer = "model.layers.0.self_attn.q_proj"
    good = {f"{layer}.lora_A": a, f"{layer}.lora_B": b, f"{layer}.lora_scaling": torch.tensor(2.0)}

    async def main():
        before = await _engine_state(url)
        answers = {
            "no_scaling": await _post(
                url,
                save({k: v for k, v in good.items() if "scaling" not in k}),
                weight_version=1,
                adapter="true",
                final="false",
            ),
            "unknown": await _post(
                url,
                save({k.replace("q_proj", "qq"): v for k, v in good.items()}),
                weight_version=1,
                adapter="true",
                final="false",
            ),
            "shape": await _post(
                url,
                save(good | {f"{layer}.lora_A": torch.zeros(2, 127)}),
                weight_version=1,
                adapter="true",
                final="false",
            ),
            "rank": await _post(
                url,
                save(good | {f"{layer}.lora_A": torch.ones(1025, 128), f"{layer}.lora_B": torch.ones(128, 1025)}),
                weight_version=1,
                adapter="true",
                final="false",
            ),
            "no_checksum": await _post(url, save(good), weight_version=1, adapter="true", final="true"),
            "sum": await _post(url, save(good), weight_version=1, adapter="true", final="true", checksum="0" * 16),
        }
        # The same through ipc's handles (SGLang's /update_weights_from_tensor, rollmesh's adapter field).
        unknown = tensor_handles.dumps([(k.replace("q_proj", "qq"), v) for k, v in good.items()])
        handles = tensor_handles.dumps(list(good.items()))
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30, headers=http_headers(AuthConfig())) as c:
                for key, payload, extra in [
                    ("ipc_unknown", unknown.payload, {}),
                    ("ipc_no_checksum", handles.payload, {"weight_version": "1"}),
                    ("ipc_sum", handles.payload, {"weight_version": "1", "checksum": "0" * 16}),
                ]:
                    body = {"serialized_named_tensors": [payload], "adapter": True, **extra}
                    answers[key] = await c.post("/update_weights_from_tensor", json=body)
        finally:
            unknown.close()
            handles.close()
        return before, answers, await _engine_state(url)

    before, answers, after = asyncio.run(main())
    for key, field in [
        ("no_scaling", "tensors"),
        ("unknown", "tensors"),
        ("shape", "tensors"),
        ("rank", "tensors"),
        ("no_checksum", "checksum"),
        ("sum", "checksum"),
        ("ipc_unknown", "tensors"),
        ("ipc_no_checksum", "checksum"),
        ("ipc_sum", "checksum"),
    ]:
        assert answers[key].status_code == 400 and field in answers[key].text, (key, answers[key].text)
    assert "needs lora_A, lora_B and lora_scaling" in answers["no_scaling"].text
    assert "rank 1025 outside [1, 1024]" in answers["rank"].text
    assert after == before
