"""LoRA adapters on vLLM (``engine.max_loaded_loras``): loaded and unloaded at run time through
vLLM's ``/v1/load_lora_adapter``, named per request, several in one batch, each answer what the
trainer's merged model computes; bad adapters are refused by field and the server keeps serving;
adapters and weights load only from below the engine's load roots; the Tinker service samples its
clients' weights through vLLM."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout.engines.http_engine import EngineRejected
from rollout.engines.vllm.config import VLLMEngineConfig
from rollout.sampling import SamplingParams
from services.auth import AuthConfig, http_headers
from services.engine.vllm_server import vllm_command
from services.llm_proxy.server import engine_client
from tests.rollout.test_engine_lora import PROMPTS, _adapter, _greedy

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_adapters")
    return {name: (root / name, _adapter(tiny_model, root / name, seed)) for name, seed in (("a", 1), ("b", 2))}


def _client(url: str):
    return engine_client(url, AuthConfig(), "vllm", timeout_s=120)


def test_the_command_switches_lora_on_only_when_asked(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", str(tmp_path))  # would load adapters by name from there
    auth = AuthConfig(token="data", control_token="t0k")
    argv, env = vllm_command(VLLMEngineConfig(model_path=tiny_model), auth)
    assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    cfg = VLLMEngineConfig(model_path=tiny_model, max_loaded_loras=3, max_lora_rank=32, load_roots=[str(tmp_path)])
    argv, env = vllm_command(cfg, auth)
    assert "--enable-lora" in argv and argv[argv.index("--max-loras") + 1] == "3"
    assert argv[argv.index("--max-lora-rank") + 1] == "32" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert not [k for k in env if k.startswith("VLLM_LORA_RESOLVER")]
    roots = env["ROLLMESH_LOAD_ROOTS"].split(os.pathsep)
    assert roots == [os.path.realpath(tiny_model), os.path.realpath(tmp_path)]
    with pytest.raises(ValueError, match="max_lora_rank"):
        VLLMEngineConfig(max_lora_rank=4)  # vLLM's buffer sizes only


def test_requests_with_different_adapters_share_the_engine_and_each_gets_its_own(vllm_engines, tiny_model, adapters):
    async def main():
        client = _client(vllm_engines[0])
        try:
            for name in ("a", "b"):
                await client.load_lora_adapter(f"t1-{name}", str(adapters[name][0]))
            jobs = {
                (lora, i): client.generate(p, GREEDY, lora_path=None if lora is None else f"t1-{lora}")
                for i, p in enumerate(PROMPTS)
                for lora in (None, "a", "b")
            }
            outs = dict(zip(jobs, await asyncio.gather(*jobs.values()), strict=True))
            for name in ("a", "b"):
                await client.unload_lora_adapter(f"t1-{name}")
            return outs
        finally:
            await client.close()

    outs = asyncio.run(main())
    for (lora, i), out in outs.items():
        state = None if lora is None else adapters[lora][1]
        assert out.output_ids == _greedy(tiny_model, state, PROMPTS[i]), (lora, i)
    assert len({tuple(outs[(lora, 0)].output_ids) for lora in (None, "a", "b")}) == 3  # the adapters matter


def test_a_request_without_an_adapter_gets_the_base_model_whatever_slots_the_adapters_hold(
    vllm_engines, tiny_model, adapters
):
    """vLLM's CPU LoRA ops gave a token without an adapter (slot -1) the last slot's adapter (Python
    indexing): rollmesh's plugin masks those rows. Adapters are loaded and unloaded in turn until
    every one of the engine's slots (max_loaded_loras 4) has held one, each time beside a request
    without an adapter in the same batch."""
    base = _greedy(tiny_model, None, PROMPTS[0])

    async def main():
        client = _client(vllm_engines[1])
        try:
            for i in range(6):
                name = f"t5-{i}"
                await client.load_lora_adapter(name, str(adapters["ab"[i % 2]][0]))
                plain, with_it = await asyncio.gather(
                    client.generate(PROMPTS[0], GREEDY), client.generate(PROMPTS[0], GREEDY, lora_path=name)
                )
                await client.unload_lora_adapter(name)
                assert plain.output_ids == base, i
                assert with_it.output_ids == _greedy(tiny_model, adapters["ab"[i % 2]][1], PROMPTS[0]), i
        finally:
            await client.close()

    asyncio.run(main())


def _variant(tmp_path, adapters, name: str, change) -> str:
    """A copy of adapter ``a`` with ``change(tensors, config)`` applied."""
    src = adapters["a"][0]
    tensors = load_file(str(src / "adapter_model.safetensors"))
    config = json.loads((src / "adapter_config.json").read_text())
    tensors, config = change(tensors, config)
    out = tmp_path / name
    out.mkdir()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config))
    return str(out)


def _wider(tensors, config):
    key = next(k for k in tensors if "lora_A" in k)
    return {k: (torch.zeros(v.shape[0], v.shape[1] * 2) if k == key else v) for k, v in tensors.items()}, config


def _rank_64(tensors, config):
    pad = {
        k: torch.cat([v, torch.zeros(64 - v.shape[0], v.shape[1])])
        if "lora_A" in k
        else torch.cat([v, torch.zeros(v.shape[0], 64 - v.shape[1])], 1)
        for k, v in tensors.items()
    }
    return pad, config | {"r": 64, "lora_alpha": 128}


def test_bad_adapters_and_requests_are_refused_by_field_and_the_engine_keeps_serving(
    vllm_engines, tiny_model, adapters, tmp_path
):
    missing = tmp_path.parent / "elsewhere"  # below the roots, but no adapter there
    link = tmp_path / "link"  # a link inside the roots that leads out of them
    link.symlink_to("/etc")

    async def main():
        client = _client(vllm_engines[0])
        refused = {}

        async def expect(key, call):
            with pytest.raises(EngineRejected) as e:
                await call
            refused[key] = (e.value.field, str(e.value))

        try:
            await client.load_lora_adapter("t2-a", str(adapters["a"][0]))
            await expect("again", client.load_lora_adapter("t2-a", str(adapters["b"][0])))
            await expect("unknown", client.generate(PROMPTS[0], GREEDY, lora_path="t2-zz"))
            await expect("outside", client.load_lora_adapter("t2-c", "/etc"))
            await expect("link", client.load_lora_adapter("t2-c", str(link)))
            await expect("missing", client.load_lora_adapter("t2-c", str(missing)))
            await expect("wide", client.load_lora_adapter("t2-c", _variant(tmp_path, adapters, "wide", _wider)))
            await expect("rank", client.load_lora_adapter("t2-c", _variant(tmp_path, adapters, "r64", _rank_64)))
            await expect("weights", client.update_weights_from_disk("/etc", 7))
            await expect("not_loaded", client.unload_lora_adapter("t2-zz"))
            after = await client.generate(PROMPTS[0], GREEDY, lora_path="t2-a")  # still serving, "a" intact
            await client.unload_lora_adapter("t2-a")
            await expect("unloaded", client.generate(PROMPTS[0], GREEDY, lora_path="t2-a"))
            version = (await client.model_info())["weight_version"]
            return refused, after, version
        finally:
            await client.close()

    refused, after, version = asyncio.run(main())
    fields = {k: f for k, (f, _) in refused.items()}
    assert fields == {
        "again": "lora_name",
        "unknown": "lora_path",
        "outside": "lora_path",
        "link": "lora_path",
        "missing": "lora_path",
        "wide": "lora_path",
        "rank": "lora_path",
        "weights": "model_path",
        "not_loaded": "lora_name",
        "unloaded": "lora_path",
    }, refused
    for key in ("outside", "link", "weights"):
        assert "load roots" in refused[key][1], refused[key]
    assert "max_lora_rank" in refused["rank"][1] or "rank" in refused["rank"][1], refused["rank"]
    assert after.output_ids == _greedy(tiny_model, adapters["a"][1], PROMPTS[0])
    assert version != 7  # the refused load labelled nothing
    with httpx.Client(base_url=vllm_engines[0], headers=http_headers(AuthConfig()), timeout=30) as c:
        models = {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert not {m for m in models if m.startswith("t2-")}, models  # nothing half-loaded stays
        # no other route loads an adapter or weights from a caller's path: vLLM's SageMaker adapter routes
        # and its own /collective_rpc methods (reload_weights takes any path) are refused by the plugin
        sagemaker = c.post("/adapters", json={"name": "t2-x", "src": str(adapters["b"][0])})
        assert sagemaker.status_code == 403 and sagemaker.json()["field"] == "path", sagemaker.text
        rpc = c.post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": "/etc"}})
        assert rpc.status_code == 403 and rpc.json()["field"] == "method", rpc.text
        relative = c.post("/v1/load_lora_adapter", json={"lora_name": "t2-r", "lora_path": "a"})
        assert relative.status_code == 400 and relative.json()["field"] == "lora_path", relative.text
        not_object = c.post("/v1/load_lora_adapter", content=b"[1]")
        assert not_object.status_code == 400 and not_object.json()["field"] == "lora_path", not_object.text
        assert c.post("/v1/load_lora_adapter", content=b"x" * 70000).status_code == 413


def test_the_tinker_service_samples_its_clients_weights_through_vllm(vllm_engines, tiny_model, tmp_path, monkeypatch):
    """`rollmesh serve tinker` with `engine.type: vllm` and the session's vLLM engine: the official SDK
    trains an adapter, saves it for sampling, and vLLM samples with it: each token's log-prob is the
    trained adapter's (the trainer's forward of the same tokens), not the base model's. An adapter of
    the output layer (the SDK's default train_unembed), which vLLM cannot serve, is refused by name."""
    import subprocess
    import sys

    import numpy as np

    tinker = pytest.importorskip("tinker", reason="the tinker SDK is a dev dependency (make setup installs it)")
    from tinker import types

    from services.gateway.keys import issue_key
    from services.processes import free_port, stop_process, wait_http_healthy

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    key = issue_key(tmp_path / "keys.json", "alice", prefix="tml-")
    port = free_port()
    sets = {
        "model_path": tiny_model,
        "engine.type": "vllm",
        "tinker.engine_url": vllm_engines[0],
        "tinker.api_keys_path": tmp_path / "keys.json",
        "tinker.root": tmp_path / "root",  # below the engine's load roots
        "tinker.port": port,
    }
    cmd = [sys.executable, "-m", "launch.cli", "serve", "tinker"]
    cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        sc = None
        try:
            wait_http_healthy(f"http://127.0.0.1:{port}/health", 120, proc)
            sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=key)
            with pytest.raises(tinker.BadRequestError, match="train_unembed"):  # vLLM adapts no lm_head
                sc.create_lora_training_client(base_model=tiny_model, rank=8).result()
            with pytest.raises(tinker.BadRequestError, match="max_lora_rank"):  # the SDK's default rank is 32
                sc.create_lora_training_client(base_model=tiny_model, train_unembed=False).result()
            tc = sc.create_lora_training_client(base_model=tiny_model, rank=8, seed=0, train_unembed=False).result()
            tokens = [1, 30, 31, 32, 33, 34, 35, 36, 37, 38]
            data = [
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
                )
            ]
            for _ in range(3):
                tc.forward_backward(data, "cross_entropy")
                tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
            sampler = tc.save_weights_and_get_sampling_client().result()
            prompt = types.ModelInput.from_ints(tokens[:4])
            params = types.SamplingParams(max_tokens=8, seed=1, temperature=1.0)
            seq = sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
            full = tokens[:4] + seq.tokens
            check = [
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)},
                )
            ]
            trained = tc.forward(check, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
            base = sc.create_lora_training_client(
                base_model=tiny_model, rank=8, train_unembed=False
            ).result()  # the base
            untrained = base.forward(check, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        finally:
            if sc is not None:
                sc.close("success").result()
            stop_process(proc)
    n = len(seq.tokens)
    np.testing.assert_allclose(seq.logprobs, trained[-n:], atol=2e-3)
    assert np.abs(np.array(untrained[-n:]) - np.array(trained[-n:])).max() > 0.1  # the adapter mattered
