"""Several LoRA adapters on one frozen base (the Tinker API's training side) and the token losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.adapter_pool import AdamParams, AdapterPool, Datum
from trainer.lora import LoraConfig
from trainer.token_losses import LOSSES, LossInputError


@pytest.fixture(scope="module")
def pool(tiny_model):
    return AdapterPool(tiny_model, micro_batch_tokens=64)


def _datum(rng, n=12, **inputs) -> Datum:
    tokens = rng.integers(0, 50, n + 1)
    return Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(n, np.float32), **inputs})


def test_each_adapter_trains_alone_and_the_base_never_moves(pool):
    rng = np.random.default_rng(0)
    data = [_datum(rng), _datum(rng, 20)]
    base = {n: p.detach().clone() for n, p in pool.base.named_parameters() if "lora_" not in n}
    pool.add("a", LoraConfig(rank=4, target_modules=pool.targets(True, True, True)), seed=0)
    pool.add("b", LoraConfig(rank=2, target_modules=["q_proj"]), seed=0)
    before_b, _ = pool.forward_backward("b", data, "cross_entropy", {}, backward=False)
    losses = []
    for _ in range(4):
        _, loss = pool.forward_backward("a", data, "cross_entropy", {})
        losses.append(loss)
        pool.optim_step("a", AdamParams(learning_rate=1e-2))
    assert losses[-1] < losses[0]
    after_b, _ = pool.forward_backward("b", data, "cross_entropy", {}, backward=False)
    for x, y in zip(before_b, after_b):
        np.testing.assert_array_equal(x, y)  # b never saw a's steps
    for n, p in pool.base.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n
    # an untrained adapter computes what the base does (B = 0), and score() reads the same
    base_lp = pool.score(np.concatenate([data[0].tokens, data[0].inputs["target_tokens"][-1:]]).tolist())
    np.testing.assert_allclose(base_lp[1:], before_b[0], atol=1e-5)
    assert np.isnan(base_lp[0])
    pool.remove("a")
    pool.remove("b")


def test_gradients_add_up_until_the_step_and_micro_batches_change_nothing(pool, tiny_model):
    rng = np.random.default_rng(1)
    data = [_datum(rng, n) for n in (5, 30, 9, 17)]
    pool.add("g", LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]), seed=3)
    one, loss_one = pool.forward_backward("g", data, "cross_entropy", {})
    grads = [p.grad.clone() for p in pool.adapters["g"].params]
    pool.adapters["g"].optimizer = None
    for p in pool.adapters["g"].params:
        p.grad = None
    wide = AdapterPool.__new__(AdapterPool)
    wide.__dict__.update(pool.__dict__, micro_batch_tokens=10_000)  # one pass for the whole call
    for half in (data[:2], data[2:]):
        wide.forward_backward("g", half, "cross_entropy", {})
    for p, g in zip(pool.adapters["g"].params, grads):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-4)
    pool.remove("g")


def test_a_saved_state_resumes_exactly_and_peft_reads_the_sampler_weights(pool, tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(2)
    data = [_datum(rng)]
    pool.add("s", LoraConfig(rank=4, target_modules=pool.targets(True, False, False)), seed=1)
    for _ in range(2):
        pool.forward_backward("s", data, "cross_entropy", {})
        pool.optim_step("s", AdamParams(learning_rate=1e-2))
    pool.save_state("s", tmp_path / "state")
    pool.save_adapter("s", tmp_path / "sampler")
    pool.load_state("t", tmp_path / "state", optimizer=True)
    for name in ("s", "t"):
        pool.forward_backward(name, data, "cross_entropy", {})
        pool.optim_step(name, AdamParams(learning_rate=1e-2))
    s, _ = pool.forward_backward("s", data, "cross_entropy", {}, backward=False)
    t, _ = pool.forward_backward("t", data, "cross_entropy", {}, backward=False)
    np.testing.assert_allclose(s[0], t[0], atol=1e-6)

    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(tmp_path / "sampler"))
    tokens = torch.as_tensor(data[0].tokens)[None]
    with torch.no_grad():
        lp = peft(tokens).logits[0].log_softmax(-1)
    want = lp.gather(-1, torch.as_tensor(data[0].inputs["target_tokens"])[:, None])[:, 0]
    scored = pool.score(
        np.concatenate([data[0].tokens, data[0].inputs["target_tokens"][-1:]]).tolist(), tmp_path / "sampler"
    )
    np.testing.assert_allclose(scored[1:], want.numpy(), atol=1e-5)
    assert "scoring" not in pool.model.peft_config  # loaded for the one call
    with pytest.raises(ValueError, match="not a saved training state"):
        pool.load_state("u", tmp_path / "sampler", optimizer=False)
    assert "u" not in pool.adapters
    pool.remove("s")
    pool.remove("t")


def test_bad_inputs_name_their_field_before_anything_is_computed(pool):
    rng = np.random.default_rng(3)
    pool.add("x", LoraConfig(rank=2, target_modules=["q_proj"]))
    good = _datum(rng)
    short = Datum(good.tokens, {"target_tokens": good.inputs["target_tokens"][:-1], "weights": good.inputs["weights"]})
    far = Datum(good.tokens, {**good.inputs, "target_tokens": good.inputs["target_tokens"] + 10**6})
    for data, field in (
        ([good, short], r"data\[1\].loss_fn_inputs.target_tokens"),
        ([far], r"data\[0\].loss_fn_inputs.target_tokens"),
        ([Datum(np.zeros(0, np.int64), {})], r"data\[0\].model_input"),
    ):
        with pytest.raises(LossInputError, match=field):
            pool.forward_backward("x", data, "cross_entropy", {})
    with pytest.raises(LossInputError, match="loss_fn"):
        pool.forward_backward("x", [good], "no_such_loss", {})
    with pytest.raises(LossInputError, match=r"data\[0\].loss_fn_inputs.logprobs"):
        pool.forward_backward("x", [good], "ppo", {})
    # GSPO: a datum whose mask marks no token fails the call before the first datum's gradient is added
    n = len(good.tokens)
    rl = {**good.inputs, "logprobs": np.zeros(n), "advantages": np.ones(n), "sequence_ratio_mask": np.ones(n)}
    empty = Datum(good.tokens, {**rl, "sequence_ratio_mask": np.zeros(n)})
    with pytest.raises(LossInputError, match=r"data\[1\].loss_fn_inputs.sequence_ratio_mask: marks no token"):
        pool.forward_backward("x", [Datum(good.tokens, rl), empty], "gspo", {})
    # a NaN clip bound or β would make every gradient of the call NaN, and the adapter after its step
    for config, field in (
        ({"clip_low_threshold": float("nan")}, "loss_fn_config.clip_low_threshold: nan"),
        ({"beta": float("inf")}, "loss_fn_config.beta: inf"),
        ({"clip_low_threshold": 1.5, "clip_high_threshold": 1.2}, "loss_fn_config: clip thresholds"),
    ):
        with pytest.raises(LossInputError, match=field):
            pool.forward_backward("x", [Datum(good.tokens, rl)], "ppo", config)
    assert all(p.grad is None for p in pool.adapters["x"].params)  # nothing half-computed
    with pytest.raises(LossInputError, match="lora_config"):
        pool.add("y", LoraConfig(rank=2, target_modules=["not_a_layer"]))
    pool.remove("x")


def test_the_policy_losses_are_their_formulas():
    lp = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    q = torch.tensor([-1.2, -0.5, -1.0])
    adv = torch.tensor([1.0, -1.0, 2.0])
    mask = torch.tensor([1.0, 1.0, 0.0])  # GSPO's sequence ratio: over the first two tokens
    inputs = {"logprobs": q, "advantages": adv, "weights": torch.tensor([0.0, 1.0, 0.5]), "sequence_ratio_mask": mask}
    r = torch.exp(lp - q)
    s = torch.exp((lp.detach() - q)[:2].mean()) * torch.exp(lp - lp.detach())  # its value, each token's gradient
    want = {
        "cross_entropy": -(lp * inputs["weights"]).sum(),
        "importance_sampling": -(r * adv).sum(),
        "ppo": -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv).sum(),
        "cispo": -(r.clamp(0.8, 1.2).detach() * lp * adv).sum(),
        "dro": -(lp * adv - 0.025 * (lp - q) ** 2).sum(),
        "gspo": -torch.minimum(s * adv, s.clamp(0.8, 1.2) * adv).sum(),
    }
    for name, fn in LOSSES.items():
        got = fn(lp, inputs, {})
        torch.testing.assert_close(got, want[name])
        (g,) = torch.autograd.grad(got, lp)
        (w,) = torch.autograd.grad(want[name], lp, retain_graph=True)
        torch.testing.assert_close(g, w)
    # PPO's clip: a ratio of e (above 1.2) with a positive advantage has no gradient
    (g,) = torch.autograd.grad(LOSSES["ppo"](lp, {**inputs, "logprobs": lp.detach() - 1}, {}), lp)
    assert g[0] == 0 and g[2] == 0
    # GSPO clips the sequence: every token's ratio is exp(mean(0.2, 0)) = 1.105, inside the range, so
    # each gradient is that value times its advantage; a sequence ratio of e clips them all (A > 0)
    (g,) = torch.autograd.grad(LOSSES["gspo"](lp, inputs, {}), lp)
    torch.testing.assert_close(g, -torch.exp(torch.tensor(0.1)) * adv)
    (g,) = torch.autograd.grad(LOSSES["gspo"](lp, {**inputs, "logprobs": lp.detach() - 1}, {}), lp)
    assert g[0] == 0 and g[2] == 0 and g[1] != 0  # A < 0: min takes the unclipped ratio
    with pytest.raises(LossInputError, match="sequence_ratio_mask"):
        LOSSES["gspo"](lp, {**inputs, "sequence_ratio_mask": torch.zeros(3)}, {})
