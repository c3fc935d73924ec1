"""The EnvManager against real services: LLMProxy + engine, SampleBuffer, AsyncController."""

from __future__ import annotations

import asyncio

import grpc
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.envs import load_jsonl
from rollout.episode import render_user_turn
from rollout.proxy import ProxyConfig
from sample_buffer.config import BufferConfig
from services.controller.config import ControllerConfig
from services.controller.server import start_controller
from services.env_manager.config import EnvManagerConfig
from services.env_manager.manager import EnvManager
from services.llm_proxy.client import ProxyClient
from services.llm_proxy.server import start_proxy
from services.pb.rollmesh.v1 import controller_pb2_grpc
from services.sample_buffer.client import BufferClient
from services.sample_buffer.server import start_buffer_service


def test_env_manager_fills_the_buffer_within_the_admission_bound(engine_url, tiny_model):
    async def main():
        proxy_server, proxy = await start_proxy(ProxyConfig(engine_urls=[engine_url], port=0, metrics_port=0))
        buf_server, buffer, refresh = await start_buffer_service(
            BufferConfig(port=0, metrics_port=0, filter_zero_variance=False)
        )
        ctl_cfg = ControllerConfig(
            proxy_address=f"127.0.0.1:{proxy_server.bound_port}",
            async_ratio=0,
            groups_per_step=3,
            port=0,
            metrics_port=0,
            initial_model_path=tiny_model,
        )
        ctl_server, ctl, ctl_proxy = await start_controller(ctl_cfg)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{ctl_server.bound_port}")
        proxy_client = ProxyClient(f"127.0.0.1:{proxy_server.bound_port}")
        buf_client = BufferClient(f"127.0.0.1:{buf_server.bound_port}")
        cfg = EnvManagerConfig(tokenizer_path=tiny_model, group_size=4, num_workers=5,
                               episode={"max_new_tokens": 3, "temperature": 1.0})  # fmt: skip
        manager = EnvManager(cfg, proxy_client, buf_client, controller_pb2_grpc.AsyncControllerStub(channel))
        try:
            await manager.start()
            for _ in range(200):
                if manager.counters["groups_put"] >= 3:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # room for a (wrong) fourth group to show up
            stats = manager.stats()
            batch = await buf_client.get(10, current_version=0, max_staleness=0, timeout_s=1)
            in_flight = ctl.in_flight
            await manager.stop()
            return stats, batch.decode(), in_flight, ctl.finished
        finally:
            for closer in (channel.close(), proxy_client.close(), buf_client.close(), ctl_proxy.close()):
                await closer
            refresh.cancel()
            for s in (ctl_server, buf_server, proxy_server):
                await s.stop(0)
            await ctl.close()
            await buffer.close()
            await proxy.close()

    stats, groups, in_flight, finished = asyncio.run(main())
    assert stats["groups_put"] == 3 and len(groups) == 3  # async_ratio 0: one step's worth, no more
    assert in_flight == 0 and finished == 3
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    rows = {f"p{i}": r for i, r in enumerate(load_jsonl("examples/arithmetic_train.jsonl"))}
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
