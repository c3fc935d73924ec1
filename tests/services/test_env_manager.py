"""The EnvManager against real services: LLMProxy + engine, SampleBuffer, AsyncController."""

from __future__ import annotations

import asyncio

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.envs import load_jsonl
from rollout.episode import render_user_turn
from services.env_manager.config import EnvManagerConfig
from services.env_manager.manager import EnvManager
from tests.services.mesh import local_mesh


def test_env_manager_fills_the_buffer_within_the_admission_bound(engine_url, tiny_model):
    async def main():
        async with local_mesh(engine_url, tiny_model, {"filter_zero_variance": False}, async_ratio=0,
                              groups_per_step=3) as mesh:  # fmt: skip
            cfg = EnvManagerConfig(tokenizer_path=tiny_model, group_size=4, num_workers=5,
                                   episode={"max_new_tokens": 3, "temperature": 1.0})  # fmt: skip
            manager = EnvManager(cfg, mesh.proxy_client, mesh.buffer_client, mesh.controller_stub)
            await manager.start()
            for _ in range(200):
                if manager.counters["groups_put"] >= 3:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # room for a (wrong) fourth group to show up
            stats = manager.stats()
            batch = await mesh.buffer_client.get(10, current_version=0, max_staleness=0, timeout_s=1)
            in_flight = mesh.controller.in_flight
            await manager.stop()
            return stats, batch.decode(), in_flight, mesh.controller.finished

    stats, groups, in_flight, finished = asyncio.run(main())
    assert stats["groups_put"] == 3 and len(groups) == 3  # async_ratio 0: one step's worth, no more
    assert in_flight == 0 and finished == 3
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    rows = {f"p{i}": r for i, r in enumerate(load_jsonl(EnvManagerConfig().dataset_path))}
    for g in groups:
        assert len(g.trajectories) == 4 and len({t.trajectory_id for t in g.trajectories}) == 4
        prompt = render_user_turn(tok, rows[g.prompt_id]["prompt"])
        for t in g.trajectories:
            ids = t.token_ids.tolist()
            assert ids[: len(prompt)] == prompt  # token-in: rendered once
            gen = ids[len(prompt) :]
            assert t.loss_mask.tolist() == [0] * len(prompt) + [1] * len(gen)
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1], -1)
            ref = lp.gather(-1, torch.tensor(gen)[:, None])[:, 0]
            assert (ref - torch.from_numpy(t.behavior_logprobs)).abs().max() <= 1e-4  # token-out
            want = float(tok.decode(gen, skip_special_tokens=True).strip() == rows[g.prompt_id]["answer"])
            assert t.reward == want and t.start_version == 0 and t.finish_reason in ("stop", "length")
