"""The trainer process loop over the real mesh: train, publish, checkpoint, resume, roll back."""

from __future__ import annotations

import asyncio
import json

from services.metrics_log import MetricsLog
from services.trainer.metrics import TrainerMetrics, TrainerObserver
from tests.services.mesh import digit_rollout, disk_train_loop, local_mesh
from trainer.config import TrainerConfig, TrainLoopConfig
from trainer.engine import TrainEngine
from trainer.loop import TrainLoop


def trainer(mesh, cfg: TrainLoopConfig, engine, groups_per_step: int, observer=None) -> TrainLoop:
    return disk_train_loop(mesh, cfg, engine, groups_per_step, max_staleness=1, observer=observer)


def test_steps_publish_versions_and_resume(make_engine_process, tiny_model, tmp_path):
    _, url = make_engine_process()
    run_dir = tmp_path / "run"

    async def main():
        async with local_mesh(
            url, tiny_model, {"filter_zero_variance": False}, async_ratio=1, groups_per_step=2
        ) as mesh:
            env = digit_rollout(mesh, tiny_model)

            def loop():
                engine = TrainEngine(TrainerConfig(model_path=tiny_model, lr=1e-3))
                cfg = TrainLoopConfig(steps=3, run_dir=str(run_dir), checkpoint_every=2, get_timeout_s=60)
                log = MetricsLog(run_dir / "metrics.jsonl")
                return trainer(mesh, cfg, engine, 2, TrainerObserver(log, TrainerMetrics()))

            await env.start()
            first = loop()
            assert not first.resume()
            await first.join()  # the same bound and version as the controller's
            steps = [await first.step() for _ in range(2)]
            first.observer.log.close()
            second = loop()  # the trainer process restarts
            assert second.resume() and second.engine.step == 2
            steps.append(await second.step())
            second.observer.log.close()
            stats = await mesh.proxy_client.stats()
            await env.stop()
            return steps, stats, mesh.controller.version

    steps, stats, version = asyncio.run(main())
    assert [m["step"] for m in steps] == [1, 2, 3] and all(m["published"] for m in steps)
    assert version == 3 and stats.weight_version == 3 and all(e.weight_version == 3 for e in stats.engines)
    assert max(m["staleness_max"] for m in steps) <= 1  # never staler than async_ratio
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and all("reward_mean" in x for x in lines)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_2", "step_3"]
    assert len(list((run_dir / "weights").iterdir())) == 2  # older exports pruned


def test_a_failed_publish_rolls_back_and_generation_goes_on(make_engine_process, tiny_model, tmp_path):
    _, url = make_engine_process()

    async def main():
        async with local_mesh(url, tiny_model, async_ratio=1, groups_per_step=1) as mesh:
            engine = TrainEngine(TrainerConfig(model_path=tiny_model, lr=1e-3))
            cfg = TrainLoopConfig(steps=1, run_dir=str(tmp_path / "run"), publish_timeout_s=10)
            loop = trainer(mesh, cfg, engine, 1)
            # Exported without config.json (the source directory is missing): every engine refuses it.
            engine.config = engine.config.model_copy(update={"model_path": str(tmp_path / "missing")})
            engine.version = 1
            ok = await loop.publish()
            out = await mesh.proxy_client.generate([1, 2, 3], 4, ignore_eos=True)
            return ok, out, mesh.controller.version, mesh.proxy.suspended, mesh.controller.counters

    ok, out, version, suspended, counters = asyncio.run(main())
    assert not ok and version == 0 and not suspended and counters["updates_aborted"] == 1
    assert len(out.output_ids) == 4 and out.weight_version == 0
