"""LoRA in the trainer (trainer/lora.py): only the adapters train; merged weights serve exactly
what the adapted model computes; the KL reference is the base with the adapters off; checkpoints
hold the adapters (also as PEFT loads them) and resume exactly; two FSDP2 ranks train as one
process; a target the model lacks is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.trainer.helpers import toy_batch
from tests.trainer.test_fsdp import _single, _two_ranks
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.config import TrainerConfig
from trainer.durable import latest_checkpoint
from trainer.engine import TrainEngine
from trainer.export import full_state_dict

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _engine(tiny_model, **extra) -> TrainEngine:
    return TrainEngine(TrainerConfig(model_path=tiny_model, lr=1e-2, micro_batch_tokens=48, lora=LORA, **extra))


def _plain_logprobs(engine: TrainEngine, state: dict, tiny_model: str, batch) -> torch.Tensor:
    """The batch's log-probs under a plain (un-wrapped) model holding ``state``."""
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    return engine.logprobs(batch, plain.eval())


def test_only_the_adapters_train_and_the_merged_weights_serve_what_the_adapted_model_computes(tiny_model):
    engine = _engine(tiny_model)
    base = {k: v.clone() for k, v in full_state_dict(engine.model).items()}
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert sum(len(g["params"]) for g in engine.optimizer.param_groups) == len(trainable)
    batch = toy_batch(seed=0)
    before = engine.logprobs(batch)
    assert torch.equal(before, _plain_logprobs(engine, base, tiny_model, batch))  # B = 0: nothing changed yet
    for seed in range(2):
        engine.train_step(toy_batch(seed=seed))
    merged = full_state_dict(engine.model)
    assert set(merged) == set(base)  # the plain model's names, the adapters folded in
    frozen = [n for n in merged if not any(t in n for t in LORA["target_modules"])]
    assert frozen and all(torch.equal(merged[n], base[n]) for n in frozen)  # untouched layers unchanged
    assert any(not torch.equal(merged[n], base[n]) for n in merged if "q_proj" in n)
    after = engine.logprobs(batch)
    assert (after - before).abs().max() > 1e-4  # it learned something
    assert torch.allclose(_plain_logprobs(engine, merged, tiny_model, batch), after, atol=1e-5)
    # PEFT's own merge agrees with ours
    peft_merged = engine.model.merge_and_unload().state_dict()
    for n, t in merged.items():
        assert torch.allclose(peft_merged[n], t, atol=1e-6), n


def test_the_kl_reference_is_the_base_with_the_adapters_off(tiny_model):
    engine = _engine(tiny_model, ref_model_path=tiny_model, kl_coef=0.1)
    assert engine.ref is None and engine.ref_is_base  # no second copy of the weights
    engine.train_step(toy_batch(seed=0))
    batch = toy_batch(seed=1)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True).eval()
    assert torch.allclose(engine._reference_logprobs(batch), engine.logprobs(batch, plain), atol=1e-6)
    assert not torch.allclose(engine.logprobs(batch), engine.logprobs(batch, plain), atol=1e-4)


def test_a_checkpoint_holds_the_adapters_and_resumes_exactly(tiny_model, tmp_path):
    from peft import PeftModel

    engine = _engine(tiny_model)
    engine.train_step(toy_batch(seed=0))
    ckpt = save_checkpoint(engine, tmp_path / "ckpt")
    again = _engine(tiny_model)
    load_checkpoint(again, latest_checkpoint(tmp_path / "ckpt"))
    assert again.step == 1
    a, b = engine.train_step(toy_batch(seed=1)), again.train_step(toy_batch(seed=1))
    assert a["loss"] == b["loss"]
    state = full_state_dict(engine.model)
    assert all(torch.equal(state[k], v) for k, v in full_state_dict(again.model).items())
    # The checkpoint holds adapters, not the model: far smaller than the weights.
    weights = sum(v.numel() * v.element_size() for v in state.values())
    saved = sum(f.stat().st_size for f in (ckpt / "state").rglob("*") if f.is_file())
    assert saved < weights / 4
    # PEFT loads the adapter directory onto the base model and computes what the trainer did.
    base = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    peft = PeftModel.from_pretrained(base, str(ckpt / "adapter")).eval()
    batch = toy_batch(seed=2)
    engine_before_step2 = _engine(tiny_model)
    load_checkpoint(engine_before_step2, ckpt)
    assert torch.allclose(engine_before_step2.logprobs(batch), engine.logprobs(batch, peft), atol=1e-6)


def test_two_fsdp2_ranks_train_adapters_like_one_process(tiny_model, tmp_path):
    sharded = _two_ranks(tiny_model, tmp_path / "lora.pt", json.dumps({"lora": LORA}))
    assert sharded["world"] == 2 and sharded["reload_equal"], "checkpoint round trip under FSDP2 changed weights"
    losses, state = _single(tiny_model, lora=LORA)
    for a, b in zip(sharded["losses"], losses):
        assert abs(a - b) <= 1e-5, (sharded["losses"], losses)
    for k, v in state.items():
        assert (sharded["state"][k] - v).abs().max().item() <= 1e-4, k


def test_a_target_the_model_lacks_is_refused_by_name(tiny_model):
    with pytest.raises(ValueError, match=r"trainer.lora.target_modules: \['qkv'\] are not linear layers"):
        TrainEngine(TrainerConfig(model_path=tiny_model, lora={"target_modules": ["q_proj", "qkv"]}))
    with pytest.raises(ValueError, match="not linear layers"):  # tied to the embedding: never served
        TrainEngine(TrainerConfig(model_path=tiny_model, lora={"target_modules": ["lm_head"]}))
    with pytest.raises(ValueError, match="trainer.lora: not with max_step_kl yet"):
        TrainEngine(TrainerConfig(model_path=tiny_model, lora={}, max_step_kl=0.1))


def test_adapters_train_the_same_through_tree_packed_rows(tiny_model):
    flat = _engine(tiny_model)
    tree = _engine(tiny_model, pack_sequences=True, tree_packing=True)
    for seed in range(2):
        a, b = flat.train_step(toy_batch(seed=seed)), tree.train_step(toy_batch(seed=seed))
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["loss"], b["loss"])
    batch = toy_batch(seed=5)
    assert torch.allclose(flat.logprobs(batch), tree.logprobs(batch), atol=1e-5)
