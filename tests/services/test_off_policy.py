"""Off-policy corrections in the running mesh: a real engine, LLMProxy, buffer and controller, an
EnvManager loop generating ahead under async_ratio 2, and the trainer loop on the tiny model.

Stale samples reach the trainer, and each loss's ratio against the policy that sampled them
moves off 1 and clips. Then the DAPO filtering path: zero-variance groups are dropped, their
admission slots come back, and the trainer is not starved.
"""

from __future__ import annotations

import asyncio

from pydantic import TypeAdapter

from services.env_manager.config import EnvManagerConfig
from services.env_manager.server import build_loop
from tests.services.mesh import disk_train_loop, local_mesh, short_run
from trainer.config import TrainerConfig
from trainer.engine import TrainEngine
from trainer.loss_config import PolicyLossConfig

# Each with knobs that let it clip within a tiny model's few steps. TIS clips at its cap only;
# decoupled PPO clips π/π_prox, which moves only with the step's own updates (4 here), not with
# staleness (its π_prox/μ weight handles that).
VARIANTS = {
    "ppo": {},
    "decoupled_ppo": {"clip_low": 0.05, "clip_high": 0.05},
    "tis": {"tis_cap": 1.2},
    "cispo": {},
    "topr": {},
}


class EachVariantInTurn(TrainEngine):
    """Step k trains under the k-th variant: one mesh run covers them all, each on real stale
    samples. (Switching losses mid-run is for this test only.)"""

    def train_step(self, batch):
        name = list(VARIANTS)[self.step % len(VARIANTS)]
        loss = TypeAdapter(PolicyLossConfig).validate_python({"type": name, **VARIANTS[name]})
        self.config = self.config.model_copy(update={"loss": loss})
        return super().train_step(batch) | {"variant": name}


def coin_reward(response: str, answer: str) -> float:
    """Half the responses score 1: most groups of 4 carry signal, some (all equal) do not."""
    return float(sum(map(ord, response)) % 2)


async def _run(
    url: str,
    model: str,
    run_dir,
    *,
    async_ratio: int,
    steps: int,
    engine: TrainEngine,
    filter_zero_variance: bool,
    reward: str,
    group_size: int = 4,
):
    buffer = {"filter_zero_variance": filter_zero_variance}
    async with local_mesh(url, model, buffer, async_ratio=async_ratio, groups_per_step=2) as mesh:
        env = build_loop(
            EnvManagerConfig(
                tokenizer_path=model,
                group_size=group_size,
                num_workers=4,
                reward=reward,
                episode={"sampling": {"max_new_tokens": 4}},
            ),
            mesh.proxy_client,
            mesh.buffer_client,
            mesh.controller_client,
        )
        loop = disk_train_loop(mesh, short_run(run_dir, steps), engine, groups_per_step=2, max_staleness=async_ratio)
        await env.start()
        try:
            await loop.join()
            metrics = [await loop.step() for _ in range(steps)]
        finally:
            await env.stop()
        return metrics, await mesh.buffer_client.stats(), mesh.controller, env.counters


def test_stale_samples_move_every_variants_ratio_off_one_and_it_clips(make_engine_process, tiny_model, tmp_path):
    _, url = make_engine_process()
    engine = EachVariantInTurn(TrainerConfig(model_path=tiny_model, lr=1e-2, mini_batches=2, ppo_epochs=2))
    run = _run(
        url,
        tiny_model,
        tmp_path / "run",
        async_ratio=2,
        steps=4 * len(VARIANTS),
        engine=engine,
        filter_zero_variance=False,
        reward=f"{__name__}:coin_reward",
    )
    metrics, *_ = asyncio.run(run)
    assert all(m is not None for m in metrics), "a step got no batch"
    assert max(m["staleness_max"] for m in metrics) >= 1  # samples of older versions reached the trainer
    for name in VARIANTS:
        mine = [m for m in metrics if m["variant"] == name]
        stale = [m for m in mine if "ratio_mean_stale" in m]
        assert stale, f"{name}: no step of it had stale tokens"
        # against the policy that sampled them, the ratio on stale tokens is not 1
        assert max(abs(m["ratio_mean_stale"] - 1) for m in stale) > 1e-3, (name, stale)
        assert max(m["clip_frac"] for m in mine) > 0, (name, [m["clip_frac"] for m in mine])
        assert all("mismatch_stale_mean" in m for m in stale)


def test_dapo_filtering_returns_slots_and_does_not_starve_the_trainer(make_engine_process, tiny_model, tmp_path):
    """Groups whose rewards are all equal are dropped by the buffer as filtered; their admission
    slots come back (else admission would stall at the bound) and every step gets its batch."""
    _, url = make_engine_process()
    engine = TrainEngine(TrainerConfig(model_path=tiny_model, lr=1e-3))
    # Groups of 2: half of them all-equal. With groups of 4 (1 in 8 all-equal) a run of ~16 groups had
    # none to filter about one time in eight, and the test failed.
    run = _run(
        url,
        tiny_model,
        tmp_path / "run",
        async_ratio=1,
        steps=6,
        engine=engine,
        filter_zero_variance=True,
        reward=f"{__name__}:coin_reward",
        group_size=2,
    )
    metrics, stats, controller, counters = asyncio.run(run)
    assert all(m is not None for m in metrics) and [m["step"] for m in metrics] == list(range(1, 7))
    assert stats.dropped_by_reason["filtered"] > 0 and counters["groups_filtered"] > 0
    # each filtered group handed its slot back unused: admission went on past the bound's first fill
    assert controller.counters["released"] >= counters["groups_filtered"]
