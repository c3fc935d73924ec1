"""The embedded engine on decoder architectures other than the tiny Qwen2, against transformers.

Tiny random-initialised Llama, Qwen2 (with windowed layers), Qwen3, Mistral (a window on every
layer) and Gemma 2 and 3 (windowed and full layers alternating): greedy output equals
``model.generate``, log-probs equal a teacher-forced forward. Windows of 8 positions under prompts
and generations several times as long, so a wrong window changes the numbers.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MambaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3NextConfig,
    T5Config,
)

from rollout.engines.embedded.attention import UnsupportedModel
from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.engine import EmbeddedEngine
from rollout.sampling import SamplingParams
from tests.rollout.test_embedded_engine import teacher_forced_logprobs

T = 60
SIZE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=None,
)
ARCHS = {
    "llama": (LlamaConfig, {}),
    "qwen2-windowed": (Qwen2Config, dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)),
    "qwen3": (Qwen3Config, {}),
    "mistral-windowed": (MistralConfig, dict(sliding_window=8)),
    "gemma2": (Gemma2Config, dict(sliding_window=8, head_dim=16)),
    "gemma3": (Gemma3TextConfig, dict(sliding_window=8, head_dim=16)),
}
PROMPTS = [[1, 20, 21, 22], [1] + list(range(40, 75)), [3] * 9, [1, 100, 101, 102, 103, 104, 105]]


def _save(name: str, out, seed: int = 0) -> str:
    cls, extra = ARCHS[name]
    config = cls(**SIZE, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random init is near-uniform; larger weights make greedy choices clear
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory):
    path = _save(request.param, tmp_path_factory.mktemp(request.param))
    engine = EmbeddedEngine(EngineConfig(model_path=path, max_running_requests=3)).start()
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation=engine.model.config._attn_implementation)
    yield request.param, engine, hf.eval()
    engine.shutdown()


def test_greedy_equals_generate_and_logprobs_equal_a_teacher_forced_forward(arch):
    _, engine, hf = arch
    # 3 running slots for 4 requests: the last joins a batch in progress, into a slot freed mid-run
    futs = [
        engine.submit(f"g{i}", p, SamplingParams(max_new_tokens=24 + 4 * i, temperature=0, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]
    for i, (p, f) in enumerate(zip(PROMPTS, futs)):
        out = f.result(T)
        ref = hf.generate(torch.tensor([p]), max_new_tokens=24 + 4 * i, do_sample=False, pad_token_id=0)
        assert out.output_ids == ref[0, len(p) :].tolist(), f"prompt {i}"
        tf = teacher_forced_logprobs(hf, p, out.output_ids)
        assert (tf - torch.tensor(out.behavior_logprobs)).abs().max().item() <= 1e-4, f"prompt {i}"


def test_sampled_logprobs_equal_a_teacher_forced_forward_while_rows_leave_and_abort(arch):
    _, engine, hf = arch
    futs = [
        engine.submit(
            f"s{i}", p, SamplingParams(max_new_tokens=10 + 9 * i, temperature=0.8, ignore_eos=True, sampling_seed=i)
        )
        for i, p in enumerate(PROMPTS)
    ]
    long = engine.submit("long", [5, 6, 7], SamplingParams(max_new_tokens=300, ignore_eos=True))
    for p, f in zip(PROMPTS, futs):
        out = f.result(T)
        tf = teacher_forced_logprobs(hf, p, out.output_ids, 0.8)
        assert (tf - torch.tensor(out.behavior_logprobs)).abs().max().item() <= 1e-4
    assert engine.abort("long").result(T) == 1
    partial = long.result(T)
    assert partial.finish_reason["type"] == "abort" and 0 < len(partial.output_ids) < 300
    tf = teacher_forced_logprobs(hf, [5, 6, 7], partial.output_ids)
    assert (tf - torch.tensor(partial.behavior_logprobs)).abs().max().item() <= 1e-4


def test_a_weight_update_from_disk_serves_the_new_weights(arch, tmp_path):
    name, engine, _ = arch
    other = _save(name, tmp_path / "b", seed=1)
    engine.load_weights_from_disk(other, 7).result(T)
    hf_b = AutoModelForCausalLM.from_pretrained(other, attn_implementation=engine.model.config._attn_implementation)
    out = engine.submit("after", PROMPTS[1], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    ref = hf_b.eval().generate(torch.tensor([PROMPTS[1]]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    result = out.result(T)
    assert result.output_ids == ref[0, len(PROMPTS[1]) :].tolist() and set(result.token_versions) == {7}
    engine.load_weights_from_disk(engine.config.model_path, 8).result(T)  # back, for the other tests


@pytest.mark.parametrize(
    "config, says",
    [
        (T5Config(vocab_size=64, d_model=32, num_layers=1, num_heads=2, d_ff=64), "encoder-decoder"),
        (Qwen3NextConfig(**SIZE, layer_types=["linear_attention", "full_attention"] * 2), "linear_attention layers"),
        (MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1), "linear_attention layers"),
        (None, "no model config transformers can read"),
    ],
    ids=["t5", "qwen3-next", "mamba", "no-model"],
)
def test_an_architecture_it_cannot_serve_is_refused_at_load_with_the_reason(config, says, tmp_path):
    if config is not None:
        config.save_pretrained(tmp_path)  # refused from its config, before any weights load
    with pytest.raises(UnsupportedModel, match=says) as e:
        EmbeddedEngine(EngineConfig(model_path=str(tmp_path)))
    assert str(tmp_path) in str(e.value)


@pytest.fixture(scope="module")
def smol(smollm2):
    from transformers import AutoTokenizer

    engine = EmbeddedEngine(EngineConfig(model_path=smollm2, max_running_requests=4)).start()
    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        for q in ("What is 17 + 25?", "Name a colour.", "Write one word that rhymes with cat, then stop talking.")
    ]
    yield engine, AutoModelForCausalLM.from_pretrained(smollm2).eval(), prompts
    engine.shutdown()


def test_smollm2_greedy_equals_generate_and_sampled_logprobs_equal_teacher_forcing(smol):
    """A real pretrained Llama-architecture model, chat-templated prompts of different lengths."""
    engine, hf, prompts = smol
    greedy = [
        engine.submit(f"sg{i}", p, SamplingParams(max_new_tokens=16, temperature=0)) for i, p in enumerate(prompts)
    ]
    sampled = [
        engine.submit(f"ss{i}", p, SamplingParams(max_new_tokens=16, sampling_seed=i, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for p, g, s in zip(prompts, greedy, sampled):
        out = g.result(T)
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :].tolist()
        assert out.output_ids == ref
        assert out.finish_reason["type"] == ("stop" if ref[-1] in engine.eos_ids else "length")
        out = s.result(T)
        tf = teacher_forced_logprobs(hf, p, out.output_ids)
        assert (tf - torch.tensor(out.behavior_logprobs)).abs().max().item() <= 1e-4
