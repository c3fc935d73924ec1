"""`rollmesh bench grammar` on the tiny model: every figure it promises, from a real run."""

from __future__ import annotations

from launch.bench.grammar_bench import run


def test_bench_grammar_reports_both_speeds_the_masking_and_the_replay(tiny_model):
    r = run(tiny_model, num_prompts=4, max_new_tokens=24, progress=lambda _: None)
    assert r["plain_tokens_per_s"] > 0 and r["constrained_tokens_per_s"] > 0
    ratio = r["constrained_tokens_per_s"] / r["plain_tokens_per_s"]  # (of the rounded speeds: near, not equal)
    assert abs(r["constrained_vs_plain"] - ratio) < 0.005
    assert 0 < r["constrained_mean_tokens"] <= 24 and 0 < r["plain_mean_tokens"] <= 24
    assert r["masking_ms_per_step"] > 0 and 0 < r["masking_share_of_constrained_wall"] < 1
    assert r["compile_cold_ms"] > r["compile_cached_ms"] >= 0
    assert 0 <= r["answers_valid"] <= 4
    # the trainer's side: the masks replayed, π on-policy with them and far off without
    assert r["trainer_replay_ms_per_1k_tokens"] > 0 and r["trainer_forward_ms_per_1k_tokens"] > 0
    assert r["pi_mu_gap_masked_max"] < 1e-4 < 0.05 < r["pi_mu_gap_unmasked_mean"]
    assert r["trainer_excluded_tokens"] == 0
