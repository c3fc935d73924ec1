"""The zero-overhead model of the admission rules that `bench async` compares the mesh with."""

from rollout.engines.sim.config import LengthModel, SimEngineConfig
from services.bench.async_ceiling import ceiling
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
    runs = {a: ceiling(SimEngineConfig(), SimTrainerConfig(), async_ratio=a, steps=60, warmup=10, **SHAPE)
            for a in (0, 1, 2, 4)}  # fmt: skip
    steps = [runs[a]["step_s"] for a in (0, 1, 2, 4)]
    occupancy = [runs[a]["engine_occupancy"] for a in (0, 1, 2, 4)]
    assert steps == sorted(steps, reverse=True) and steps[0] > 2.5 * steps[2]
    assert occupancy == sorted(occupancy) and occupancy[0] < 0.3 and occupancy[3] > 0.8
