"""`rollmesh bench moe`: a short run reports the mismatch with and without routing replay, and refuses a
dense model."""

from __future__ import annotations

from launch.bench.moe_bench import mismatch
from tests.cli import rollmesh


def test_the_mismatch_with_replay_is_measured_against_the_free_routers(tiny_moe):
    out = mismatch(tiny_moe, "bfloat16", num_prompts=6, max_new_tokens=8, progress=lambda _: None)
    assert out["generated_tokens"] == 6 * 8 and (out["moe_layers"], out["top_k"], out["num_experts"]) == (4, 2, 8)
    for side in ("free", "replay"):
        assert 0 < out[side]["abs_diff_mean"] <= out[side]["abs_diff_max"]  # bfloat16 against float32
        assert 0 <= out[side]["kl_k3"] < 1  # k3 is never negative
    assert 0 <= out["routing_differs_share"] <= out["routing_differs_token_share"] <= 1


def test_bench_moe_refuses_a_dense_model(tiny_model):
    res = rollmesh("bench", "moe", "--model", tiny_model, "--json")
    assert res.exit_code == 2 and "has no mixture-of-experts layers" in res.stderr, res.stderr[-2000:]
    assert "{" not in res.stdout  # no result line
