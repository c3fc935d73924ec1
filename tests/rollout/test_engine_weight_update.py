"""Weight updates: from disk and from tensor buckets, with requests in flight."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.engines.contract import EngineError
from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.engine import EmbeddedEngine
from rollout.engines.embedded.weights import weights_checksum
from rollout.sampling import SamplingParams
from tests.rollout.engine_waits import wait_decoding

T = 60
GREEDY = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
PROMPT = [1, 30, 31, 32, 33]


@pytest.fixture
def engine(tiny_model):
    eng = EmbeddedEngine(EngineConfig(model_path=tiny_model)).start()
    yield eng
    eng.shutdown()


def greedy(model, prompt, n=40):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_update_from_disk_serves_the_new_weights(engine, tiny_model_b):
    before = engine.submit("a", PROMPT, GREEDY).result(T).output_ids
    res = engine.load_weights_from_disk(tiny_model_b, 7).result(T)
    b = AutoModelForCausalLM.from_pretrained(tiny_model_b).eval()
    assert res["weight_version"] == 7 and engine.weight_version == 7
    assert res["checksum"] == weights_checksum(b.state_dict())
    out = engine.submit("b", PROMPT, GREEDY).result(T)
    assert out.output_ids == greedy(b, PROMPT) != before
    assert set(out.token_versions) == {7}


def test_update_from_tensor_buckets_equals_loading_directly(engine, tiny_model_b):
    b = AutoModelForCausalLM.from_pretrained(tiny_model_b).eval()
    state = {k: v for k, v in b.state_dict().items() if k != "lm_head.weight"}  # tied to the embedding
    names = sorted(state)
    for i in range(0, len(names), 7):  # buckets of 7 tensors
        engine.stage_tensors({n: state[n] for n in names[i : i + 7]}, 3)
    res = engine.commit_staged(3).result(T)
    assert res["checksum"] == weights_checksum(b.state_dict())
    assert engine.submit("t", PROMPT, GREEDY).result(T).output_ids == greedy(b, PROMPT)


def test_bad_tensors_are_refused_and_nothing_changes(engine):
    version, checksum = engine.weight_version, engine.checksum
    with pytest.raises(EngineError, match="unknown tensor name 'nope'"):
        engine.stage_tensors({"nope": torch.zeros(2)}, 9)
    with pytest.raises(EngineError, match="shape"):
        engine.stage_tensors({"model.norm.weight": torch.zeros(3)}, 9)
    with pytest.raises(EngineError, match="parameters not sent"):
        engine.commit_staged(9).result(T)
    assert (engine.weight_version, engine.checksum) == (version, checksum)


def test_in_flight_request_is_reprefilled_under_new_weights(engine, tiny_model, tiny_model_b):
    """No KV computed under old weights is reused: the tokens after the switch are exactly what the
    new model generates greedily from prompt + the tokens before the switch."""
    fut = engine.submit("long", PROMPT, SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True))
    wait_decoding(engine, "long")
    engine.load_weights_from_disk(tiny_model_b, 1).result(T)
    out = fut.result(T)
    switch = out.token_versions.index(1)
    assert 0 < switch < 300 and set(out.token_versions[:switch]) == {0}
    a = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    b = AutoModelForCausalLM.from_pretrained(tiny_model_b).eval()
    assert out.output_ids[:switch] == greedy(a, PROMPT, switch)
    prefix = PROMPT + out.output_ids[:switch]
    assert out.output_ids[switch:] == greedy(b, prefix, 300 - switch)


def test_incompatible_model_is_refused(engine, tmp_path):
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    other = build_tiny_model(tmp_path / "wide", TinyModelConfig(hidden_size=64, num_attention_heads=4))
    with pytest.raises(EngineError, match="model_path: .* does not fit the served model"):
        engine.load_weights_from_disk(str(other), 5).result(T)
    assert engine.weight_version == 0


def test_kv_on_update_keep_goes_on_over_the_old_weights_cache(tiny_model, tiny_model_b):
    """engine.kv_on_update keep (SGLang's in-place pause): nothing is re-prefilled. The tokens after the
    switch are what the new model generates greedily over the cache the old one wrote for everything
    forwarded before the switch; each is tagged with the new version."""
    engine = EmbeddedEngine(EngineConfig(model_path=tiny_model, kv_on_update="keep")).start()
    try:
        fut = engine.submit("long", PROMPT, SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True))
        wait_decoding(engine, "long")
        engine.pause("in_place").result(T)
        prefilled = engine.counters["prefill_tokens"]
        assert engine.load_weights_from_disk(tiny_model_b, 1).result(T)["retracted"] == 0
        engine.resume().result(T)
        out = fut.result(T)
        assert engine.counters["prefill_tokens"] == prefilled  # the running request was not prefilled again
    finally:
        engine.shutdown()
    switch = out.token_versions.index(1)
    assert 0 < switch < 300 and set(out.token_versions[switch:]) == {1}
    a = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    b = AutoModelForCausalLM.from_pretrained(tiny_model_b).eval()
    with torch.no_grad():  # the old model's cache of all but the last token sampled before the switch
        cache = a(torch.tensor([PROMPT + out.output_ids[: switch - 1]]), use_cache=True).past_key_values
        token, after = out.output_ids[switch - 1], []
        for _ in range(300 - switch):  # the new model decodes on over it
            logits = b(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
            token = int(logits[0, -1].argmax())
            after.append(token)
    assert out.output_ids[switch:] == after
    assert out.output_ids[:switch] == greedy(a, PROMPT, switch)
