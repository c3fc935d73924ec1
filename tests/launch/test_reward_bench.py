"""`rollmesh bench reward` at a small scale: real sandboxes, a few answers that never end."""

from __future__ import annotations

import pytest

from launch.bench import BadOption
from launch.bench.reward_bench import run


def test_the_adaptive_timeout_saves_sandbox_time_and_loses_no_correct_answer():
    out = run(
        tasks=4,
        per_task=6,
        base_s=0.05,
        hang_share=0.2,
        # A floor well above a loaded machine's start-up of a sandboxed run (two test workers beside
        # it took right answers past 2 x the fastest at 0.3 s): what is measured is the cut of the
        # runs that never end, 3 s fixed against 1 s adaptive.
        fixed_s=3.0,
        t_min_s=1.0,
        lam=2.0,
        concurrency=2,
        seed=1,
        progress=lambda _: None,
    )
    assert out["hanging"] >= 2 and out["fixed_timeouts"] == out["hanging"] == out["adaptive_timeouts"]
    assert out["correct_lost_by_adaptive"] == 0 and out["fixed_correct"] == out["adaptive_correct"] == out["right"]
    assert out["adaptive_cuts"] >= 1 and out["adaptive_sandbox_s"] < out["fixed_sandbox_s"]
    for key in (
        "sandbox_runs_per_s_1",
        "sandbox_runs_per_s_2",
        "math_verify_per_s_inline",
        "math_verify_per_s_workers_1",
        "math_verify_per_s_workers_2",
        "math_verify_per_s_service_2_workers",
        "score_ms_p50_service",
        "score_ms_p50_local_worker",
    ):
        assert out[key] > 0, key
    with pytest.raises(BadOption, match="--base-s"):
        run(4, 6, 1.0, 0.05, 2.0, 0.3, 2.0, 2, 0, lambda _: None)
