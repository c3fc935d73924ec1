"""Each estimator against a literal, loop-by-loop implementation of its definition."""

import math
import typing

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from trainer.advantage_config import AdvantageConfig
from trainer.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    dr_grpo,
    gae,
    grpo,
    reinforce_pp,
    rloo,
)
from trainer.config import TrainerConfig


def batch():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(8, generator=g, dtype=torch.float64)
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])
    mask = torch.zeros(8, 6, dtype=torch.float64)
    for i, (s, e) in enumerate([(1, 6), (2, 5), (0, 6), (3, 6), (1, 4), (2, 6), (0, 2), (1, 6)]):
        mask[i, s:e] = 1
    return rewards, mask, group_ids


def advantage_config(type_: str, **knobs):
    """An estimator's config as a YAML ``advantages:`` block gives it: through the tagged union."""
    return TypeAdapter(AdvantageConfig).validate_python({"type": type_, **knobs})


def literal_group(rewards, group_ids):
    groups = {}
    for i, gid in enumerate(group_ids.tolist()):
        groups.setdefault(gid, []).append(float(rewards[i]))
    return groups


def test_grpo_and_dr_grpo():
    rewards, mask, gids = batch()
    groups = literal_group(rewards, gids)
    (out, no_returns), (out_dr, _) = grpo(rewards, mask, gids, eps=1e-6), dr_grpo(rewards, mask, gids)
    assert no_returns is None  # critic-free
    for i, gid in enumerate(gids.tolist()):
        rs = groups[gid]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / max(1, len(rs) - 1))
        for t in range(6):
            want = (float(rewards[i]) - mean) / (std + 1e-6) if mask[i, t] else 0.0
            assert out[i, t].item() == pytest.approx(want, abs=1e-9)
            assert out_dr[i, t].item() == pytest.approx((float(rewards[i]) - mean) * float(mask[i, t]), abs=1e-12)


def test_rloo_leave_one_out():
    rewards, mask, gids = batch()
    groups = literal_group(rewards, gids)
    out, _ = rloo(rewards, mask, gids)
    for i, gid in enumerate(gids.tolist()):
        rs = groups[gid]
        r = float(rewards[i])
        want = 0.0 if len(rs) == 1 else r - (sum(rs) - r) / (len(rs) - 1)
        assert out[i][mask[i] > 0].tolist() == pytest.approx([want] * int(mask[i].sum()), abs=1e-12)


def test_gae_matches_the_recursion():
    rewards, mask, gids = batch()
    values = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    gamma, lam = 0.9, 0.8
    adv, ret = gae(rewards, mask, gids, values=values, gamma=gamma, lam=lam)
    for i in range(8):
        idx = [t for t in range(6) if mask[i, t]]
        r = [0.0] * len(idx)
        r[-1] = float(rewards[i])
        a_next, want = 0.0, {}
        for k in reversed(range(len(idx))):
            v = float(values[i, idx[k]])
            v_next = float(values[i, idx[k + 1]]) if k + 1 < len(idx) else 0.0
            a_next = r[k] + gamma * v_next - v + gamma * lam * a_next
            want[idx[k]] = a_next
        for t in range(6):
            assert adv[i, t].item() == pytest.approx(want.get(t, 0.0), abs=1e-9)
            assert ret[i, t].item() == pytest.approx((want[t] + float(values[i, t])) if t in want else 0.0, abs=1e-9)


def test_reinforce_pp_whitens_discounted_returns():
    rewards, mask, gids = batch()
    out, _ = reinforce_pp(rewards, mask, gids, gamma=0.95)
    raw = []
    for i in range(8):
        idx = [t for t in range(6) if mask[i, t]]
        for k in range(len(idx)):
            raw.append((i, idx[k], float(rewards[i]) * 0.95 ** (len(idx) - 1 - k)))
    vals = [v for _, _, v in raw]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    for i, t, v in raw:
        assert out[i, t].item() == pytest.approx((v - mean) / math.sqrt(std**2 + 1e-6), abs=1e-6)
    assert out[mask == 0].abs().max() == 0


def test_clipping_whitening_and_errors():
    rewards, mask, gids = batch()
    clipped, _ = compute_advantages(advantage_config("dr_grpo", reward_clip=0.1), rewards, mask, gids)
    assert clipped.abs().max() <= 0.2 + 1e-12
    white, _ = compute_advantages(advantage_config("rloo", whiten=True), rewards, mask, gids)
    assert abs(white[mask > 0].mean().item()) < 1e-9
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        advantage_config("nope")
    with pytest.raises(ValueError, match="critic"):
        compute_advantages(advantage_config("gae"), rewards, mask, gids)


def test_compute_advantages_passes_each_estimator_its_own_knobs():
    rewards, mask, gids = batch()
    values = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    cases = [
        (advantage_config("grpo", norm_by_std=False), dr_grpo(rewards, mask, gids)),
        (advantage_config("reinforce_pp", gamma=0.9), reinforce_pp(rewards, mask, gids, gamma=0.9)),
        (advantage_config("gae", gamma=0.9, lam=0.8), gae(rewards, mask, gids, values=values, gamma=0.9, lam=0.8)),
    ]
    for cfg, (want_adv, want_ret) in cases:
        adv, ret = compute_advantages(cfg, rewards, mask, gids, values)
        torch.testing.assert_close(adv, want_adv)
        assert (ret is None) == (want_ret is None) and (ret is None or torch.equal(ret, want_ret))


def test_every_config_type_has_its_estimator():
    variants = typing.get_args(typing.get_args(AdvantageConfig)[0])
    assert {cls.model_fields["type"].default for cls in variants} == set(ADVANTAGE_ESTIMATORS)
    for cls in variants:
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no description"
    assert TrainerConfig().advantages.type == "grpo" and TrainerConfig().advantages.norm_by_std


@pytest.mark.parametrize(
    "advantages, expected",
    [
        ({"type": "nope"}, r"advantages\n.*Input tag 'nope' found using .* does not match .*'grpo'"),
        ({"type": "grpo", "lam": 0.9}, r"advantages\.grpo\.lam\n\s+Extra inputs are not permitted"),
        ({"estimator": "gae"}, r"advantages\.grpo\.estimator\n\s+Extra inputs are not permitted"),  # the old key
    ],
)
def test_bad_advantage_configs_fail_at_load_naming_the_key(advantages, expected):
    with pytest.raises(ValidationError, match=expected):
        TrainerConfig.model_validate({"advantages": advantages})
