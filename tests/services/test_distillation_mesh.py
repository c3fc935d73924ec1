"""On-policy distillation in the mesh: a teacher's LLMProxy scores every group's tokens the moment the
group ends, the log-probs travel with the trajectories to the trainer, and a teacher that fails
drops its groups, counted, while rollout goes on."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.proxy import ProxyConfig
from services.env_manager.config import EnvManagerConfig
from services.env_manager.server import build_loop
from services.llm_proxy.client import ProxyClient, ProxyTeacher
from services.llm_proxy.server import start_proxy
from services.processes import free_port
from tests.services.mesh import local_mesh


async def _run_until(manager, counter: str, n: int, polls: int = 600) -> None:
    await manager.start()
    for _ in range(polls):
        if manager.counters[counter] >= n:
            break
        await asyncio.sleep(0.05)
    await manager.stop()


def _config(tiny_model: str, **kw) -> EnvManagerConfig:
    # Two-token answers at temperature 1 from an untrained model: most groups' rewards are all 0, which
    # the zero-variance filter (on here) would drop were they not taught.
    episode = {"sampling": {"max_new_tokens": 2, "temperature": 1.0}}
    return EnvManagerConfig(tokenizer_path=tiny_model, group_size=2, num_workers=2, episode=episode, **kw)


def test_a_teachers_log_probs_of_each_generated_token_reach_the_trainers_groups(
    engine_url, make_engine_process, tiny_model, tiny_model_b
):
    _, teacher_url = make_engine_process(model=tiny_model_b)

    async def main():
        teacher_server, teacher_proxy = await start_proxy(
            ProxyConfig(engine_urls=[teacher_url], port=0, metrics_port=0)
        )
        teacher = ProxyClient(f"127.0.0.1:{teacher_server.bound_port}")
        try:
            async with local_mesh(engine_url, tiny_model, async_ratio=0, groups_per_step=3) as mesh:
                manager = build_loop(
                    _config(tiny_model, teacher="big", teacher_top_k=3),
                    mesh.proxy_client,
                    mesh.buffer_client,
                    mesh.controller_client,
                    teachers={"big": teacher},
                )
                await _run_until(manager, "groups_put", 3)
                batch = await mesh.buffer_client.get(3, version=0, max_staleness=0, timeout_s=5)
                return batch.decode(), dict(manager.counters), dict(teacher_proxy.counters)
        finally:
            await teacher.close()
            await teacher_server.stop(0)
            await teacher_proxy.close()

    groups, counters, teacher_counters = asyncio.run(main())
    assert len(groups) == 3 and counters.get("groups_teacher_error", 0) == 0
    big = AutoModelForCausalLM.from_pretrained(tiny_model_b).eval()
    scored = 0
    for g in groups:
        assert g.taught
        for t in g.trajectories:
            ids, gen = t.token_ids.tolist(), t.loss_mask.astype(bool)
            with torch.no_grad():
                lp = torch.log_softmax(big(torch.tensor([ids])).logits[0, :-1].float(), -1)
            ref = lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()[gen[1:]]
            assert t.teacher_logprobs.shape == t.behavior_logprobs.shape
            assert np.abs(ref - t.teacher_logprobs).max() <= 1e-4  # the teacher's, token by token
            assert np.abs(t.behavior_logprobs - t.teacher_logprobs).max() > 1e-3  # not the student's
            # and at each generated position its three most likely tokens, best first
            best = lp[torch.from_numpy(gen[1:])].topk(3, dim=-1)
            assert t.teacher_top_ids.tolist() == best.indices.tolist()
            assert np.abs(t.teacher_top_logprobs - best.values.numpy()).max() <= 1e-4
            scored += t.num_generated
    assert teacher_counters["scored_tokens"] >= scored


def test_a_teacher_that_is_down_drops_its_groups_counted_and_rollout_goes_on(engine_url, tiny_model):
    async def main():
        gone = ProxyClient(f"127.0.0.1:{free_port()}")  # nothing listens there
        try:
            async with local_mesh(engine_url, tiny_model, async_ratio=1, groups_per_step=2) as mesh:
                manager = build_loop(
                    _config(tiny_model, teacher="big", teacher_timeout_s=1),
                    mesh.proxy_client,
                    mesh.buffer_client,
                    mesh.controller_client,
                    teachers={"big": gone},
                )
                # The bound (async_ratio 1, 2 groups a step) admits 4 groups until slots come back: 6
                # dropped groups means each dropped one returned its slot.
                await _run_until(manager, "groups_teacher_error", 6)
                return dict(manager.counters)
        finally:
            await gone.close()

    counters = asyncio.run(main())
    assert counters["groups_teacher_error"] >= 6 and counters.get("groups_put", 0) == 0


def test_a_teacher_that_comes_back_within_the_deadline_loses_no_group(engine_url, make_engine_process, tiny_model):
    """The teacher's proxy is down when rollout starts (a restart): its groups are asked again until
    their deadline, and once it serves they are taught and put, none dropped."""
    _, teacher_url = make_engine_process()
    port = free_port()

    async def main():
        teacher = ProxyClient(f"127.0.0.1:{port}")
        server = proxy = None
        try:
            async with local_mesh(engine_url, tiny_model, async_ratio=1, groups_per_step=2) as mesh:
                manager = build_loop(
                    _config(tiny_model, teacher="big", teacher_timeout_s=30),
                    mesh.proxy_client,
                    mesh.buffer_client,
                    mesh.controller_client,
                    teachers={"big": teacher},
                )
                await manager.start()
                await asyncio.sleep(1.5)  # groups end meanwhile, their teacher unreachable
                down = manager.counters["groups_put"]
                server, proxy = await start_proxy(ProxyConfig(engine_urls=[teacher_url], port=port, metrics_port=0))
                for _ in range(600):
                    if manager.counters["groups_put"] >= 2:
                        break
                    await asyncio.sleep(0.05)
                await manager.stop()
                return down, dict(manager.counters)
        finally:
            await teacher.close()
            if server is not None:
                await server.stop(0)
                await proxy.close()

    down, counters = asyncio.run(main())
    assert down == 0 and counters["groups_put"] >= 2, counters
    assert counters.get("groups_teacher_error", 0) == 0, counters


def test_a_task_naming_a_teacher_the_mesh_lacks_is_refused_by_name(engine_url, tiny_model):
    async def main():
        async with local_mesh(engine_url, tiny_model) as mesh:
            build_loop(
                _config(tiny_model, teacher="big"), mesh.proxy_client, mesh.buffer_client, mesh.controller_client
            )

    with pytest.raises(ValueError, match=r"teacher: no teacher 'big' in the mesh"):
        asyncio.run(main())


def test_the_teachers_proxy_retries_a_failed_engine_and_refuses_bad_input_by_field(make_engine_process, tiny_model_b):
    _, url = make_engine_process(model=tiny_model_b)

    async def main():
        dead = f"http://127.0.0.1:{free_port()}"
        server, proxy = await start_proxy(ProxyConfig(engine_urls=[dead, url], port=0, metrics_port=0))
        client = ProxyClient(f"127.0.0.1:{server.bound_port}")
        teacher = ProxyTeacher(client)
        try:
            got = [await teacher.score([1, 30, 31, 32], 1, route="", timeout_s=30, top_k=2) for _ in range(3)]
            errors = []
            for ids, start, k in (([], 1, 0), ([1, 2], 0, 0), ([1, 2], 2, 0), ([1, 10**6], 1, 0), ([1, 2], 1, 65)):
                try:
                    await teacher.score(ids, start, route="", timeout_s=10, top_k=k)
                except ValueError as e:
                    errors.append(str(e))
            healthy = {s.url: s.healthy for s in proxy.router.engines}
            return got, errors, healthy
        finally:
            await client.close()
            await server.stop(0)
            await proxy.close()

    got, errors, healthy = asyncio.run(main())
    assert all(g.logprobs == got[0].logprobs and len(g.logprobs) == 3 for g in got)
    assert got[0].top_ids.shape == got[0].top_logprobs.shape == (3, 2)
    assert (got[0].top_logprobs[:, 0] >= got[0].top_logprobs[:, 1]).all()
    assert (got[0].top_logprobs[:, 0] >= np.asarray(got[0].logprobs) - 1e-6).all()  # the best is at least the token
    assert [e.split(":")[0] for e in errors] == ["input_ids", "start", "start", "input_ids", "top_k"], errors
    assert not any(v for u, v in healthy.items() if u != url) and healthy[url]
