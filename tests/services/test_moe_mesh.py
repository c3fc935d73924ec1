"""Routing replay in the running mesh: a tiny Qwen3-MoE served by a real engine process, the LLMProxy,
buffer and controller, an EnvManager loop recording routing under async_ratio 2, and the trainer
replaying it. Every trajectory arrives with routing for every position but its last (through the
gRPC proxy, the codec and the buffer) and trains; the engine's μ equals the trainer's π on fresh
tokens, as both run float32."""

from __future__ import annotations

import asyncio

from services.env_manager.config import EnvManagerConfig
from services.env_manager.server import build_loop
from tests.services.mesh import disk_train_loop, local_mesh, short_run
from trainer.config import TrainerConfig
from trainer.engine import TrainEngine

STEPS = 3


class Recording(TrainEngine):
    """Keeps each step's batch: what reached the trainer."""

    def train_step(self, batch):
        self.seen = [*getattr(self, "seen", []), batch]
        return super().train_step(batch)


async def _run(url: str, model: str, run_dir, engine: TrainEngine):
    async with local_mesh(url, model, async_ratio=2, groups_per_step=2) as mesh:
        env = build_loop(
            EnvManagerConfig(
                tokenizer_path=model,
                group_size=4,
                num_workers=3,
                reward="digit_answer",
                return_routed_experts=True,
                episode={"sampling": {"max_new_tokens": 6}},
            ),
            mesh.proxy_client,
            mesh.buffer_client,
            mesh.controller_client,
        )
        loop = disk_train_loop(mesh, short_run(run_dir, STEPS), engine, groups_per_step=2, max_staleness=2)
        await env.start()
        try:
            await loop.join()
            return [await loop.step() for _ in range(STEPS)]
        finally:
            await env.stop()


def test_routing_recorded_by_the_engine_reaches_the_trainer_and_is_replayed(make_engine_process, tiny_moe, tmp_path):
    _, url = make_engine_process(model=tiny_moe)
    engine = Recording(TrainerConfig(model_path=tiny_moe, lr=1e-3, moe={"routing": "replay"}))
    metrics = asyncio.run(_run(url, tiny_moe, tmp_path / "run", engine))
    assert all(m is not None for m in metrics), "a step got no batch"
    assert all(m["routing_dropped"] == 0 and m["tokens"] > 0 for m in metrics)
    for batch in engine.seen:
        for seq, experts in zip(batch.sequences, batch.routed_experts, strict=True):
            assert experts.shape == (len(seq) - 1, 4 * 2)
    fresh = [m["mismatch_fresh_max"] for m in metrics if "mismatch_fresh_max" in m]
    assert fresh and max(fresh) <= 1e-4  # float32 engine, float32 trainer, the same experts
