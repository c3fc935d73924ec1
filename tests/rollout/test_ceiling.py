"""The zero-overhead model of the admission rules that `bench async` compares the mesh with."""

import pytest

from launch.bench.ceiling_bench import plan
from rollout.engines.sim.ceiling import ceiling, sweep
from rollout.engines.sim.config import LengthModel, SimEngineConfig
from trainer.sim import SimTrainerConfig

SHAPE = dict(engines=2, max_running=64, groups_per_step=16, group_size=8, max_new_tokens=16384)


def test_fixed_lengths_give_the_analytic_synchronous_step():
    """Every response 100 tokens: 128 sequences fill 2 x 64 slots exactly, so one synchronous step is
    100 decode steps at batch 64, then training, then the weight load."""
    sim = SimEngineConfig(lengths=LengthModel(median=100, p99=100, cap=100))
    trainer = SimTrainerConfig()
    r = ceiling(sim, trainer, async_ratio=0, steps=10, warmup=2, **SHAPE)
    train = trainer.step_overhead_s + 128 * 100 / trainer.train_tokens_per_s
    expected = 100 * sim.step_s(64) + train + sim.weight_load_s
    assert abs(r["step_s"] - expected) < 1e-6
    assert r["tokens_per_step"] == 128 * 100


def test_asynchrony_shortens_steps_and_fills_engines_under_the_long_tail():
    runs = {
        a: ceiling(SimEngineConfig(), SimTrainerConfig(), async_ratio=a, steps=60, warmup=10, **SHAPE)
        for a in (0, 1, 2, 4)
    }
    steps = [runs[a]["step_s"] for a in (0, 1, 2, 4)]
    occupancy = [runs[a]["engine_occupancy"] for a in (0, 1, 2, 4)]
    assert steps == sorted(steps, reverse=True) and steps[0] > 2.5 * steps[2]
    assert occupancy == sorted(occupancy) and occupancy[0] < 0.3 and occupancy[3] > 0.8


def test_the_sweep_shows_larger_steps_need_a_smaller_async_ratio():
    """ROLL Flash's Table 1 in the model: next to the engines' slots, a bigger step fills them at a
    lower ratio. And a bound that stops long groups trains fewer tokens per step than synchronous."""
    shape = dict(engines=2, max_running=64, group_size=8, max_new_tokens=16384, steps=30, warmup=6)
    rows = sweep(SimEngineConfig(), SimTrainerConfig(), groups_per_step=[8, 32], async_ratios=[1, 2], **shape)
    at = {(r["groups_per_step"], r["async_ratio"]): r for r in rows}
    assert set(at) == {(8, 1), (8, 2), (32, 1), (32, 2)}  # ratio 0 is played as the reference, not listed
    assert at[(32, 2)]["efficiency"] > at[(8, 2)]["efficiency"] + 0.15
    assert at[(8, 2)]["efficiency"] > at[(8, 1)]["efficiency"]
    assert all(r["speedup_vs_sync"] > 1 for r in rows)
    assert at[(8, 1)]["trained_tokens_vs_sync"] < 0.95  # long-tailed groups outlived the bound
    for r in rows:
        assert abs(r["efficiency"] - r["ideal_step_s"] / r["step_s"]) < 1e-9


def test_plan_reads_the_workload_from_a_run_config(tmp_path, tiny_model):
    from launch.bench.async_bench import SCENARIOS, _config
    from launch.config import load_config

    path = _config(
        tmp_path,
        "w",
        SCENARIOS["async_2"],
        False,
        engines=3,
        time_scale=25,
        steps=3,
        tokenizer=tiny_model,
        groups_per_step=4,
    )
    lines: list[str] = []
    out = plan(load_config(path, []), [24], [2, 4], target=0.5, progress=lines.append)
    assert (out["engines"], out["max_running"], out["group_size"]) == (3, 64, 8)
    assert len(lines) == 3 and "async_ratio 0" in lines[0]  # the synchronous reference is shown
    assert out["needed_async_ratio_gps24"] in (2, 4)
    assert out["efficiency_gps24_async4"] >= 0.5
    with pytest.raises(ValueError, match="groups_per_step"):
        plan(None, [0], [2])


def test_the_cli_names_a_bad_option_without_a_traceback():
    from tests.cli import rollmesh

    res = rollmesh("bench", "ceiling", "--groups-per-step", "0")
    assert res.exit_code == 2 and "groups_per_step" in res.stderr and isinstance(res.exception, SystemExit)
