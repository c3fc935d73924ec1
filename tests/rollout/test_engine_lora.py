"""LoRA adapters in the embedded engine (rollout/engines/embedded/lora.py): a request generated
with an adapter equals the trainer's merged model, requests with different adapters (and none)
share a batch without touching each other, and an adapter that does not fit is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rollout.engines.contract import EngineError
from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.engine import EmbeddedEngine
from rollout.sampling import SamplingParams
from tests.trainer.helpers import toy_batch
from trainer.config import TrainerConfig
from trainer.engine import TrainEngine
from trainer.export import export_adapter

T = 60
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = ([1, 30, 31, 32], [1, 50, 7, 9, 11, 2], [1, 99])


def _adapter(tiny_model, out, seed: int) -> dict:
    """Train adapters a few steps (large steps: they must change greedy answers); export them; return
    the merged weights (what the trainer would publish)."""
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    trainer = TrainEngine(TrainerConfig(model_path=tiny_model, lr=5e-2, lora=lora, seed=seed))
    for s in range(3):
        trainer.train_step(toy_batch(seed=seed * 10 + s))
    export_adapter(trainer.model, out)
    return trainer.full_weights()


def _greedy(tiny_model, state, prompt) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    if state is not None:
        model.load_state_dict(state, strict=False)
    ids = model.eval().generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: (root / name, _adapter(tiny_model, root / name, seed)) for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture
def engine(tiny_model):
    eng = EmbeddedEngine(EngineConfig(model_path=tiny_model, max_running_requests=16, max_prefill_tokens=4096)).start()
    yield eng
    eng.shutdown()


def test_requests_with_different_adapters_share_a_batch_and_each_gets_its_own(engine, tiny_model, adapters):
    engine.load_lora_adapter("a", str(adapters["a"][0]), version=3).result(T)
    engine.load_lora_adapter("b", str(adapters["b"][0]), version=5).result(T)
    engine.pause("in_place").result(T)  # queue them all first: they run in one batch
    futures = {
        (lora, i): engine.submit(f"{lora}-{i}", p, GREEDY, lora=lora)
        for i, p in enumerate(PROMPTS)
        for lora in (None, "a", "b")
    }
    engine.resume().result(T)
    outs = {k: f.result(T) for k, f in futures.items()}
    assert engine.counters["prefill_batches"] == 1  # all nine in one batch
    for (lora, i), out in outs.items():
        state = None if lora is None else adapters[lora][1]
        assert out.output_ids == _greedy(tiny_model, state, PROMPTS[i]), (lora, i)
        assert set(out.token_versions) == {{None: 0, "a": 3, "b": 5}[lora]}
    kinds = [outs[(lora, 0)].output_ids for lora in (None, "a", "b")]
    assert len({tuple(k) for k in kinds}) == 3  # three different answers: the adapters matter


def test_an_adapter_in_use_stays_and_a_name_is_loaded_once(engine, adapters):
    engine.load_lora_adapter("a", str(adapters["a"][0])).result(T)
    with pytest.raises(EngineError, match="loaded already") as e:
        engine.load_lora_adapter("a", str(adapters["b"][0]))
    assert e.value.field == "lora_name"
    engine.pause("in_place").result(T)
    fut = engine.submit("r", PROMPTS[0], GREEDY, lora="a")
    with pytest.raises(EngineError, match="1 request\\(s\\) waiting or running use adapter 'a'"):
        engine.unload_lora_adapter("a").result(T)
    engine.resume().result(T)
    fut.result(T)
    assert engine.unload_lora_adapter("a").result(T) == {"loaded_adapters": []}
    with pytest.raises(EngineError, match="no adapter named 'a' is loaded") as e:
        engine.submit("s", PROMPTS[0], GREEDY, lora="a")
    assert e.value.field == "lora_path"


def test_an_adapter_that_does_not_fit_the_model_is_refused(engine, adapters, tmp_path):
    src = adapters["a"][0]
    tensors = load_file(str(src / "adapter_model.safetensors"))
    config = json.loads((src / "adapter_config.json").read_text())

    def variant(name: str, tensors: dict, config: dict):
        out = tmp_path / name
        out.mkdir()
        save_file(tensors, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps(config))
        return str(out)

    key = next(k for k in tensors if "lora_A" in k)
    wider = {k: (torch.zeros(v.shape[0], v.shape[1] * 2) if k == key else v) for k, v in tensors.items()}
    renamed = {k.replace("q_proj", "qkv_proj"): v for k, v in tensors.items()}
    for path, match in [
        (variant("wide", wider, config), "another base model"),
        (variant("renamed", renamed, config), "is not a linear layer of the served model"),
        (variant("dora", tensors, config | {"use_dora": True}), "only plain LoRA"),
        (variant("rank", tensors, config | {"r": 0}), "needs r in"),
        (str(tmp_path / "none"), "not a PEFT LoRA adapter directory"),
    ]:
        with pytest.raises(EngineError, match=match) as e:
            engine.load_lora_adapter("x", path)
        assert e.value.field == "lora_path"
    assert engine.adapters.by_name == {}


def test_the_engine_server_speaks_sglangs_lora_api(make_engine_process, tiny_model, adapters, tmp_path):
    """Over HTTP: load, generate with lora_path (one per prompt of a batch), unload; bad requests get a
    400 naming the field and the server keeps serving."""
    import httpx

    from services.auth import AuthConfig, http_headers

    url = make_engine_process(model=tiny_model)[1]
    with httpx.Client(base_url=url, timeout=60, headers=http_headers(AuthConfig())) as c:
        ok = c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a"][0])})
        assert ok.status_code == 200 and ok.json()["loaded_adapters"] == ["a"], ok.text
        sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        batch = c.post(
            "/generate", json={"input_ids": [PROMPTS[0]] * 2, "sampling_params": sp, "lora_path": ["a", None]}
        )
        assert batch.status_code == 200, batch.text
        with_a, base = (r["output_ids"] for r in batch.json())
        assert with_a == _greedy(tiny_model, adapters["a"][1], PROMPTS[0])
        assert base == _greedy(tiny_model, None, PROMPTS[0])
        bad = {
            "unknown": c.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": sp, "lora_path": "zz"}),
            "count": c.post("/generate", json={"input_ids": [PROMPTS[0]], "lora_path": ["a", "a"]}),
            "again": c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["b"][0])}),
            "outside": c.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": "/etc"}),
            "empty": c.post("/load_lora_adapter", json={"lora_name": "", "lora_path": str(adapters["b"][0])}),
            "not_loaded": c.post("/unload_lora_adapter", json={"lora_name": "zz"}),
        }
        for key, field in [
            ("unknown", "lora_path"),
            ("count", "lora_path"),
            ("again", "lora_name"),
            ("outside", "lora_path"),
            ("empty", "lora_name"),
            ("not_loaded", "lora_name"),
        ]:
            assert bad[key].status_code in (400, 422), (key, bad[key].text)
            assert field in bad[key].text, (key, bad[key].text)
        assert c.post("/unload_lora_adapter", json={"lora_name": "a"}).json()["loaded_adapters"] == []
        assert c.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": sp}).json()["output_ids"] == base
