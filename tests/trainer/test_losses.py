"""Every policy loss against a literal per-token implementation of its paper's formula."""

from __future__ import annotations

import math
import typing

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from trainer.config import TrainerConfig
from trainer.loss_config import CustomLossConfig, MismatchCorrection, PolicyLossConfig
from trainer.losses import (
    POLICY_LOSSES,
    aggregate,
    kl_penalty,
    mismatch_stats,
    mismatch_weights,
    policy_loss,
    reinforce,
    value_loss,
)

B, T = 6, 7


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # Ratios from e^-2 to e^2: far outside every clip range as well as inside.
    lp = (old + (torch.rand(B, T, generator=g, dtype=torch.float64) * 4 - 2)).clamp(max=-1e-3)
    behav = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5).clamp(max=-1e-3)
    prox = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).clamp(max=-1e-3)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv[1] = adv[1, 0]  # constant within a sequence, like outcome rewards
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[0, :] = 0  # a fully masked sequence
    mask[2, :] = 1
    return lp.requires_grad_(True), old, behav, prox, adv, mask


def lit_tokens(fn, lp, mask):
    """Literal per-token losses: fn(b, t) computed with Python floats, 0 where masked."""
    return [[fn(b, t) if mask[b, t] else 0.0 for t in range(T)] for b in range(B)]


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def f(x):
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def loss_config(type_: str, **knobs):
    """A variant's config as a YAML ``loss:`` block gives it: through the tagged union."""
    return TypeAdapter(PolicyLossConfig).validate_python({"type": type_, **knobs})


# The knobs the literal formulas below use, each given to the variant that reads it.
CFG = {
    "ppo": loss_config("ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0),
    "decoupled_ppo": loss_config("decoupled_ppo", clip_low=0.2, clip_high=0.28),
    "tis": loss_config("tis", tis_cap=2.0),
    "cispo": loss_config("cispo", cispo_clip_high=0.28),
    "topr": loss_config("topr"),
    "reinforce": loss_config("reinforce"),
}


def literal(variant, cfg, lp, old, behav, prox, adv, b, t):
    """``old``: the denominator the variant's ``old_policy`` names (μ or π_prox)."""
    lp_, old_, mu, px, a = f(lp[b, t]), f(old[b, t]), f(behav[b, t]), f(prox[b, t]), f(adv[b, t])
    r = math.exp(lp_ - old_)
    if variant == "ppo":
        loss = max(-a * r, -a * clip(r, 1 - cfg.clip_low, 1 + cfg.clip_high))
        return min(loss, -a * cfg.dual_clip) if a < 0 else loss
    if variant == "decoupled_ppo":
        rp = math.exp(lp_ - px)
        w = min(math.exp(px - mu), cfg.behavior_weight_cap)
        return w * max(-a * rp, -a * clip(rp, 1 - cfg.clip_low, 1 + cfg.clip_high))
    if variant == "tis":
        return -min(r, cfg.tis_cap) * a * lp_
    if variant == "cispo":
        return -clip(r, 1 - cfg.cispo_clip_low, 1 + cfg.cispo_clip_high) * a * lp_
    if variant == "topr":
        return -a * lp_ if a >= 0 else -min(r, 1.0) * a * lp_
    if variant == "reinforce":
        return -a * lp_
    raise KeyError(variant)


def literal_weight_grad(variant, cfg, lp, old, behav, prox, adv, b, t):
    """d(per-token loss)/d(log π) of the literal formula, stop-gradients respected."""
    lp_, old_, mu, px, a = f(lp[b, t]), f(old[b, t]), f(behav[b, t]), f(prox[b, t]), f(adv[b, t])
    r = math.exp(lp_ - old_)
    if variant == "ppo":
        lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
        unclipped, clipped = -a * r, -a * clip(r, lo, hi)
        loss = max(unclipped, clipped)
        if a < 0 and -a * cfg.dual_clip < loss:
            return 0.0
        if unclipped >= clipped:
            return -a * r
        return 0.0
    if variant == "decoupled_ppo":
        rp = math.exp(lp_ - px)
        w = min(math.exp(px - mu), cfg.behavior_weight_cap)
        lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
        return w * (-a * rp) if -a * rp >= -a * clip(rp, lo, hi) else 0.0
    if variant == "tis":
        return -min(r, cfg.tis_cap) * a
    if variant == "cispo":
        return -clip(r, 1 - cfg.cispo_clip_low, 1 + cfg.cispo_clip_high) * a
    if variant == "topr":
        return -a if a >= 0 else -min(r, 1.0) * a
    if variant == "reinforce":
        return -a
    raise KeyError(variant)


VARIANT_POLICIES = [(v, p) for v in ("ppo", "tis", "cispo", "topr") for p in ("behavior", "proximal")]
VARIANT_POLICIES += [("decoupled_ppo", None), ("reinforce", None)]


@pytest.mark.parametrize("variant, old_policy", VARIANT_POLICIES)
def test_token_level_variants_match_literal_formula(variant, old_policy):
    """Each variant against its formula with the ratio's denominator its ``old_policy`` names:
    μ (the engine's log-probs) or π_prox; decoupled PPO uses both, REINFORCE neither."""
    lp, _, behav, prox, adv, mask = inputs()
    update = {"agg_mode": "token-mean"} | ({"old_policy": old_policy} if old_policy else {})
    cfg = CFG[variant].model_copy(update=update)
    old = behav if old_policy == "behavior" else prox
    loss, metrics = policy_loss(lp, adv, mask, behavior_logprobs=behav, proximal_logprobs=prox, config=cfg)
    lit = lit_tokens(lambda b, t: literal(variant, cfg, lp, old, behav, prox, adv, b, t), lp, mask)
    n = float(mask.sum())
    assert loss.item() == pytest.approx(sum(map(sum, lit)) / n, rel=1e-10, abs=1e-12)
    loss.backward()
    for b in range(B):
        for t in range(T):
            want = literal_weight_grad(variant, cfg, lp, old, behav, prox, adv, b, t) / n if mask[b, t] else 0.0
            assert lp.grad[b, t].item() == pytest.approx(want, rel=1e-9, abs=1e-12), (variant, b, t)
    assert 0.0 <= metrics["clip_frac"] <= 1.0 and metrics["ratio_max"] >= metrics["ratio_mean"] > 0
    m = mask.bool()  # the ratio against each policy, whichever the variant uses
    assert metrics["ratio_behavior_mean"] == pytest.approx(f((lp - behav)[m].exp().mean()), rel=1e-12)
    assert metrics["ratio_proximal_mean"] == pytest.approx(f((lp - prox)[m].exp().mean()), rel=1e-12)


def test_the_defaults_take_the_ratio_against_the_sampling_policy():
    """PPO, GSPO, TIS, CISPO and TOPR default to μ, the policy that sampled the tokens (π_old as the
    papers write it); a config may name π_prox instead."""
    for variant in ("ppo", "gspo", "tis", "cispo", "topr"):
        assert loss_config(variant).old_policy == "behavior"
        assert loss_config(variant, old_policy="proximal").old_policy == "proximal"
    with pytest.raises(ValidationError, match="old_policy"):
        loss_config("decoupled_ppo", old_policy="behavior")  # uses both, by construction
    with pytest.raises(ValidationError, match="old_policy"):
        loss_config("ppo", old_policy="reference")


def test_stale_token_metrics_cover_the_stale_tokens_alone():
    lp, _, behav, prox, adv, mask = inputs(2)
    stale = torch.zeros(B, T, dtype=torch.bool)
    stale[2] = True  # one whole trajectory sampled by older weights
    cfg = loss_config("ppo")
    _, metrics = policy_loss(lp, adv, mask, behavior_logprobs=behav, proximal_logprobs=prox, config=cfg, stale=stale)
    m = mask.bool() & stale
    assert metrics["stale_tokens"] == float(m.sum()) > 0
    assert metrics["ratio_mean_stale"] == pytest.approx(f((lp - behav)[m].exp().mean()), rel=1e-12)
    _, fresh_only = policy_loss(
        lp, adv, mask, behavior_logprobs=behav, proximal_logprobs=prox, config=cfg, stale=torch.zeros_like(stale)
    )
    assert "ratio_mean_stale" not in fresh_only and "stale_tokens" not in fresh_only


@pytest.mark.parametrize("kind", ["truncate", "mask"])
def test_mismatch_corrections_match_their_formulas(kind):
    """Truncated IS min(π_prox/μ, C) and IcePop-style masking outside [α, β], token by token, and
    the loss they weight."""
    lp, _, behav, prox, adv, mask = inputs(6)
    config = TypeAdapter(MismatchCorrection).validate_python(
        {"type": kind, "cap": 1.5} if kind == "truncate" else {"type": kind, "low": 0.8, "high": 1.25}
    )
    weights = mismatch_weights(config, prox, behav)
    for b in range(B):
        for t in range(T):
            r = math.exp(f(prox[b, t]) - f(behav[b, t]))
            want = min(r, 1.5) if kind == "truncate" else float(0.8 <= r <= 1.25)
            assert f(weights[b, t]) == pytest.approx(want, rel=1e-12), (b, t)
    cfg = CFG["reinforce"]
    weighted, _ = policy_loss(
        lp, adv, mask, behavior_logprobs=behav, proximal_logprobs=prox, config=cfg, token_weights=weights
    )
    lit = lit_tokens(lambda b, t: -f(adv[b, t]) * f(lp[b, t]) * f(weights[b, t]), lp, mask)
    assert weighted.item() == pytest.approx(sum(map(sum, lit)) / float(mask.sum()), rel=1e-10)
    assert mismatch_weights(TypeAdapter(MismatchCorrection).validate_python({"type": "none"}), prox, behav) is None
    with pytest.raises(ValidationError, match="low"):
        TypeAdapter(MismatchCorrection).validate_python({"type": "mask", "low": 2.0, "high": 1.0})


def test_a_mismatch_correction_goes_only_with_a_ratio_against_the_proximal_policy():
    with pytest.raises(ValidationError, match="already takes"):
        TrainerConfig.model_validate({"mismatch": {"type": "truncate"}})  # decoupled PPO weights by π_prox/μ
    with pytest.raises(ValidationError, match="old_policy: proximal"):
        TrainerConfig.model_validate({"mismatch": {"type": "mask"}, "loss": {"type": "cispo"}})
    cfg = TrainerConfig.model_validate(
        {"mismatch": {"type": "mask"}, "loss": {"type": "cispo", "old_policy": "proximal"}}
    )
    assert cfg.mismatch.type == "mask"


def test_mismatch_stats_split_fresh_and_stale_tokens():
    _, _, behav, prox, _, mask = inputs(8)
    stale = torch.zeros(B, T, dtype=torch.bool)
    stale[3:] = True
    got = mismatch_stats(prox, behav, mask, stale)
    for name, m in (("fresh", mask.bool() & ~stale), ("stale", mask.bool() & stale)):
        gaps = [abs(f(behav[b, t]) - f(prox[b, t])) for b in range(B) for t in range(T) if m[b, t]]
        assert got[f"mismatch_{name}_mean"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-9)
        assert got[f"mismatch_{name}_max"] == pytest.approx(max(gaps), rel=1e-9)
        assert got[f"mismatch_{name}_tokens"] == len(gaps)


def test_gspo_is_the_sequence_level_clipped_objective():
    lp, old, _, _, adv, mask = inputs(3)
    seq_adv = adv[:, :1].expand(B, T).contiguous()  # GSPO's advantage is per sequence
    cfg = loss_config("gspo", agg_mode="seq-mean-token-mean", gspo_clip_low=0.1, gspo_clip_high=0.15)
    loss, _ = policy_loss(lp, seq_adv, mask, behavior_logprobs=old, proximal_logprobs=old, config=cfg)
    loss.backward()
    want, grads = [], torch.zeros(B, T, dtype=torch.float64)
    rows = [b for b in range(B) if mask[b].sum() > 0]
    for b in rows:
        idx = [t for t in range(T) if mask[b, t]]
        s = math.exp(sum(f(lp[b, t]) - f(old[b, t]) for t in idx) / len(idx))
        a = f(seq_adv[b, 0])
        unclipped, clipped = -a * s, -a * clip(s, 0.9, 1.15)
        want.append(max(unclipped, clipped))
        if unclipped >= clipped:  # d(-a s)/d lp_t = -a s / |idx|
            for t in idx:
                grads[b, t] = -a * s / len(idx) / len(rows)
    assert loss.item() == pytest.approx(sum(want) / len(rows), rel=1e-10)
    torch.testing.assert_close(lp.grad, grads, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_modes(mode):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.4).double()
    mask[3] = 0
    rows = [b for b in range(B) if mask[b].sum()]
    tok = {b: [f(x[b, t]) for t in range(T) if mask[b, t]] for b in rows}
    want = {
        "token-mean": sum(map(sum, tok.values())) / sum(map(len, tok.values())),
        "seq-mean-token-sum": sum(sum(v) for v in tok.values()) / len(rows),
        "seq-mean-token-mean": sum(sum(v) / len(v) for v in tok.values()) / len(rows),
        "seq-mean-token-sum-norm": sum(map(sum, tok.values())) / (len(rows) * 11),
    }[mode]
    assert aggregate(x, mask, mode, norm_len=11).item() == pytest.approx(want, rel=1e-12)


def test_smooth_pieces_pass_gradcheck():
    lp, old, behav, prox, adv, mask = inputs(7)
    x = lp.detach().clone().requires_grad_(True)
    cfg = loss_config("reinforce", agg_mode="seq-mean-token-mean")
    kw = {"behavior_logprobs": old, "proximal_logprobs": old, "config": cfg}
    assert torch.autograd.gradcheck(lambda z: policy_loss(z, adv, mask, **kw)[0], (x,))
    for kind in ("k1", "k2", "k3"):
        assert torch.autograd.gradcheck(lambda z, k=kind: kl_penalty(z, old, k).sum(), (x,))
    v = torch.randn(B, T, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: value_loss(z, z.detach(), old, mask, clip=None), (v,))


def test_kl_estimators_and_value_loss_literal():
    lp, old, *_ = inputs(9)
    r = (old - lp).exp()  # π_ref / π
    torch.testing.assert_close(kl_penalty(lp, old, "k1"), lp - old)
    torch.testing.assert_close(kl_penalty(lp, old, "k2"), 0.5 * (lp - old) ** 2)
    torch.testing.assert_close(kl_penalty(lp, old, "k3"), r - 1 - r.log())
    v, v_old, ret = torch.tensor([[1.0, 3.0]]), torch.tensor([[0.5, 1.0]]), torch.tensor([[2.0, 0.0]])
    # token 0: max((1-2)², (0.7-2)²) = 1.69; token 1: max(9, (1.2-0)²) = 9 → 0.5·mean = 2.6725
    assert value_loss(v, v_old, ret, torch.ones(1, 2), clip=0.2).item() == pytest.approx(2.6725)


def test_registry_errors_and_custom_variant():
    lp, old, behav, prox, adv, mask = inputs()
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        loss_config("nope")
    custom_cfg = loss_config("custom", function="trainer.losses:reinforce")
    assert isinstance(custom_cfg, CustomLossConfig)
    kw = {"behavior_logprobs": behav, "proximal_logprobs": prox}
    custom, _ = policy_loss(lp, adv, mask, config=custom_cfg, **kw)
    builtin, _ = policy_loss(lp, adv, mask, config=CFG["reinforce"], **kw)
    assert custom.item() == builtin.item() and set(POLICY_LOSSES) >= {"ppo", "gspo", "topr"}


def test_every_config_type_has_its_loss():
    """The tagged union and the registry are two halves of one table: neither has a name the other lacks."""
    variants = typing.get_args(typing.get_args(PolicyLossConfig)[0])
    assert {cls.model_fields["type"].default for cls in variants} == set(POLICY_LOSSES)
    for cls in variants:
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no description"


def test_default_loss_is_decoupled_ppo_with_its_knobs():
    loss = TrainerConfig().loss
    assert loss.type == "decoupled_ppo"
    assert (loss.clip_low, loss.clip_high, loss.behavior_weight_cap) == (0.2, 0.28, 5.0)
    assert (loss.agg_mode, loss.norm_len) == ("token-mean", None)


def scaled_reinforce(logprobs, old_logprobs, advantages, mask, *, config, **_):
    """A user's own loss: REINFORCE times a knob of its own, read from ``config.params``."""
    loss, ratio, clipped = reinforce(logprobs, old_logprobs, advantages, mask, config=config)
    return loss * config.params["scale"], ratio, clipped


def test_custom_loss_by_import_path_runs_with_its_own_params():
    lp, old, _, _, adv, mask = inputs(4)
    custom = {"type": "custom", "function": f"{__name__}:scaled_reinforce", "params": {"scale": 3.0}}
    cfg = TrainerConfig.model_validate({"loss": custom}).loss
    kw = {"behavior_logprobs": old, "proximal_logprobs": old}
    got, _ = policy_loss(lp, adv, mask, config=cfg, **kw)
    want, _ = policy_loss(lp, adv, mask, config=CFG["reinforce"], **kw)
    assert got.item() == pytest.approx(3.0 * want.item(), rel=1e-12)


@pytest.mark.parametrize(
    "loss, expected",
    [
        # An unknown type names the key and the choices.
        ({"type": "nope"}, r"loss\n.*Input tag 'nope' found using .* does not match .*'decoupled_ppo'"),
        # A knob of another variant is rejected under the variant that got it.
        ({"type": "ppo", "tis_cap": 2.0}, r"loss\.ppo\.tis_cap\n\s+Extra inputs are not permitted"),
        # The key before the rename fails loudly instead of leaving the default in force.
        ({"variant": "ppo"}, r"loss\.decoupled_ppo\.variant\n\s+Extra inputs are not permitted"),
        # A custom loss that cannot be imported fails at load, not at the first training step.
        ({"type": "custom", "function": "no_such_module:loss"}, r"loss\.custom\.function\n.*cannot import"),
        ({"type": "custom", "function": "trainer.losses:no_such_loss"}, r"loss\.custom\.function\n.*cannot import"),
        ({"type": "custom", "function": "reinforce"}, r"loss\.custom\.function\n.*expected 'module:function'"),
        ({"type": "custom", "function": "trainer.losses:POLICY_LOSSES"}, r"loss\.custom\.function\n.*not callable"),
        ({"type": "custom"}, r"loss\.custom\.function\n\s+Field required"),
    ],
)
def test_bad_loss_configs_fail_at_load_naming_the_key(loss, expected):
    with pytest.raises(ValidationError, match=expected):
        TrainerConfig.model_validate({"loss": loss})
