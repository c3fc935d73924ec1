"""The embedded engine on decoder architectures other than the tiny Qwen2, against transformers.

Tiny random-initialised Llama, Qwen2 (with windowed layers), Qwen3, Mistral (a window on every
layer), Gemma 2 and 3 (windowed and full layers alternating) and the mixture-of-experts decoders
Qwen2-MoE (with a shared expert and a dense layer), Qwen3-MoE, Mixtral and OLMoE: greedy output
equals ``model.generate``, log-probs equal a teacher-forced forward. Windows of 8 positions under
prompts and generations several times as long, so a wrong window changes the numbers. MoE models
also report each position's experts, equal to the routers' choices in a teacher-forced forward.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MambaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    T5Config,
)

from rollout.engines.contract import EngineError
from rollout.engines.embedded.attention import UnsupportedModel
from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.engine import EmbeddedEngine
from rollout.engines.embedded.routing import RoutingCapture
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
    # MoE: 8 experts, top-2 (Qwen2-MoE: a shared expert, and layer 1 a dense MLP)
    "qwen2-moe": (
        Qwen2MoeConfig,
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3-moe": (Qwen3MoeConfig, dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)),
    "mixtral": (MixtralConfig, dict(num_local_experts=8, num_experts_per_tok=2)),
    "olmoe": (OlmoeConfig, dict(num_experts=8, num_experts_per_tok=2)),
}
MOE = {"qwen2-moe": [0, 2, 3], "qwen3-moe": [0, 1, 2, 3], "mixtral": [0, 1, 2, 3], "olmoe": [0, 1, 2, 3]}  # MoE layers
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


def test_an_moe_model_reports_the_experts_of_every_forwarded_position_as_a_forward_routes_them(arch):
    name, engine, hf = arch
    if name not in MOE:
        with pytest.raises(EngineError, match="no mixture-of-experts layers") as e:
            engine.submit("r", [1, 2], SamplingParams(max_new_tokens=2), return_routed_experts=True)
        assert e.value.field == "return_routed_experts"
        return
    capture = RoutingCapture(hf)
    assert (capture.layers, capture.moe_layers, capture.top_k) == (4, MOE[name], 2)
    sampling = [
        SamplingParams(max_new_tokens=14 + 5 * i, temperature=0.8, sampling_seed=i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    # 3 slots, 4 requests joining and leaving; one request without routing rides in the same batches
    futs = [engine.submit(f"r{i}", p, s, return_routed_experts=True) for i, (p, s) in enumerate(zip(PROMPTS, sampling))]
    plain = engine.submit("plain", PROMPTS[0], sampling[0])
    for p, f in zip(PROMPTS, futs):
        out = f.result(T)
        context = p + out.output_ids
        with torch.no_grad():
            hf(input_ids=torch.tensor([context[:-1]]))  # every position but the last, as the engine forwarded
        want = capture.take(1, len(context) - 1)[0]
        got = out.routed_experts
        assert got.shape == (len(context) - 1, 4 * 2) and got.dtype == np.uint8  # SGLang's: every layer
        dense = [layer for layer in range(4) if layer not in MOE[name]]
        assert all((got.reshape(len(got), 4, 2)[:, layer] == 0).all() for layer in dense)
        # top-2 ids in the router's order: equal as sets (the order of two equal gates is the kernel's)
        assert (np.sort(got.reshape(len(got), -1, 2), -1) == np.sort(want.reshape(len(got), -1, 2), -1)).all()
    assert plain.result(T).routed_experts is None
    capture.remove()


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
