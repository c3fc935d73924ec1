"""The EnvManager against real services: LLMProxy + engine, SampleBuffer, AsyncController."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.chat_turns import render_prompt
from rollout.envs import load_jsonl
from rollout.ports import TransientError
from rollout.proxy import ProxyConfig
from rollout.sampling import SamplingParams
from sample_buffer.deadlines import wait_for
from services.env_manager.config import EnvManagerConfig
from services.env_manager.server import build_loop
from services.llm_proxy.client import ProxyClient, ProxyGenerate
from services.llm_proxy.server import start_proxy
from services.processes import free_port
from tests.services.mesh import local_mesh


def test_env_manager_fills_the_buffer_within_the_admission_bound(engine_url, tiny_model):
    async def main():
        async with local_mesh(
            engine_url, tiny_model, {"filter_zero_variance": False}, async_ratio=0, groups_per_step=3
        ) as mesh:
            cfg = EnvManagerConfig(
                tokenizer_path=tiny_model,
                group_size=4,
                num_workers=5,
                episode={"sampling": {"max_new_tokens": 3, "temperature": 1.0}},
            )
            manager = build_loop(cfg, mesh.proxy_client, mesh.buffer_client, mesh.controller_client)
            await manager.start()
            for _ in range(200):
                if manager.counters["groups_put"] >= 3:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # room for a (wrong) fourth group to show up
            stats = dict(manager.counters)
            batch = await mesh.buffer_client.get(10, version=0, max_staleness=0, timeout_s=1)
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
        prompt = render_prompt(tok, rows[g.prompt_id]["prompt"])
        for t in g.trajectories:
            ids = t.token_ids.tolist()
            assert ids[: len(prompt)] == prompt  # token-in: rendered once
            gen = ids[len(prompt) :]
            assert t.loss_mask.tolist() == [0] * len(prompt) + [1] * len(gen)
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1], -1)
            ref = lp.gather(-1, torch.tensor(gen)[:, None])[:, 0]
            assert (ref - torch.tensor(t.behavior_logprobs)).abs().max() <= 1e-4  # token-out
            want = float(tok.decode(gen, skip_special_tokens=True).strip() == rows[g.prompt_id]["answer"])
            assert t.reward == want and t.start_version == 0 and t.finish_reason in ("stop", "length")


async def two_groups_with(engine_url: str, tiny_model: str, until: str = "groups_put", **cfg):
    """An EnvManager with ``cfg`` on a real mesh until 2 groups of 2 are put (``until``: or counted so
    otherwise): the manager, the groups, its /metrics text and the LLMProxy's request count."""
    from prometheus_client import generate_latest

    async with local_mesh(
        engine_url, tiny_model, {"filter_zero_variance": False}, async_ratio=0, groups_per_step=2
    ) as mesh:
        episode = {"sampling": {"max_new_tokens": 3}, **cfg.pop("episode", {})}
        config = EnvManagerConfig(tokenizer_path=tiny_model, group_size=2, num_workers=2, episode=episode, **cfg)
        manager = build_loop(config, mesh.proxy_client, mesh.buffer_client, mesh.controller_client)
        await manager.start()
        for _ in range(400):
            if manager.counters[until] >= 2:
                break
            await asyncio.sleep(0.05)
        await manager.stop()
        batch = await mesh.buffer_client.get(10, version=0, max_staleness=0, timeout_s=1)
        text = generate_latest(manager.observer.registry).decode()
        return manager, batch.decode(), text, mesh.proxy.counters["requests"]


def test_rewards_scored_in_worker_processes_count_their_failures(engine_url, tiny_model):
    """reward_workers: the verifier runs in worker processes; one that raises scores 0, the group is
    still put, and each failure is counted by cause on the EnvManager's /metrics."""
    manager, groups, metrics, _ = asyncio.run(
        two_groups_with(
            engine_url,
            tiny_model,
            reward="tests.rollout.reward_fns:always_raise",
            reward_workers={"workers": 2, "timeout_s": 10},
        )
    )
    manager.observer.reward_source.close()
    assert manager.counters["groups_put"] == 2 and all(t.reward == 0.0 for g in groups for t in g.trajectories)
    assert 'rollmesh_env_reward_failures_total{cause="raised"} 4.0' in metrics
    assert 'rollmesh_env_reward_failures_total{cause="timeout"} 0.0' in metrics


def test_an_llm_judge_through_the_proxy_scores_and_stays_out_of_the_trajectories(engine_url, tiny_model):
    """reward: {type: judge} with the mesh's own LLMProxy as the judge (the policy judges itself): each
    answer is scored by one judge generation through the proxy, and the trajectories hold only the
    task's prompt and the policy's answer. (The tiny model's verdicts are noise, so the pattern here
    takes any text as the verdict ''; parsing real verdicts: tests/rollout/test_judge.py.)"""
    judge = {
        "type": "judge",
        "template": "Reference: {answer}\nAnswer: {response}\nVerdict:",
        "verdict_pattern": "()",
        "scores": {"": 1.0},
        "max_new_tokens": 4,
        "timeout_s": 20,
    }
    manager, groups, metrics, proxy_requests = asyncio.run(two_groups_with(engine_url, tiny_model, reward=judge))
    judge = manager.observer.reward_source
    assert len(groups) == 2 and all(t.reward == 1.0 for g in groups for t in g.trajectories)
    # Each answer judged once, through the same proxy: its requests are the policy's and the judge's.
    assert judge.calls >= manager.counters["trajectories_put"] == 4 and proxy_requests >= 2 * judge.calls
    assert 'rollmesh_env_reward_failures_total{cause="unparsed"} 0.0' in metrics
    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = {f"p{i}": r for i, r in enumerate(load_jsonl(EnvManagerConfig().dataset_path))}
    for g in groups:
        prompt = render_prompt(tok, rows[g.prompt_id]["prompt"])
        for t in g.trajectories:  # the task's prompt and at most 3 policy tokens: nothing of the judge's
            assert t.token_ids.tolist()[: len(prompt)] == prompt and len(t.token_ids) <= len(prompt) + 3


class HeldEnv:
    """Single-turn; the second episode of each group waits in its step until ``HeldEnv.held`` is set,
    so its group is still rolling out, one member finished, when the version moves on."""

    name = "held"
    held: asyncio.Event
    made = 0

    def __init__(self, rows, reward_fn=None) -> None:
        self.rows, self.index = rows, HeldEnv.made
        HeldEnv.made += 1

    def reset(self, seed: int) -> str:
        return self.rows[seed % len(self.rows)]["prompt"]

    async def step(self, action: str):
        from rollout.envs.base import StepResult

        if self.index % 2:
            await wait_for(HeldEnv.held.wait(), 30)
        return StepResult(None, float(self.index % 2), True)


def test_a_group_that_outlives_the_bound_is_stopped_counted_and_its_slot_returned(make_engine_process, tiny_model):
    """async_ratio 0: once v1 is committed, a group with a member finished at v0 can never be trained.
    The EnvManager stops it (never put), counts it and its tokens, and gives its slot back."""
    from prometheus_client import generate_latest

    engine_url = make_engine_process()[1]  # its own: the weight update below must not leak into other tests

    async def main():
        HeldEnv.held, HeldEnv.made = asyncio.Event(), 0
        async with local_mesh(
            engine_url, tiny_model, {"filter_zero_variance": False}, async_ratio=0, groups_per_step=1
        ) as mesh:
            cfg = EnvManagerConfig(
                tokenizer_path=tiny_model,
                group_size=2,
                num_workers=1,
                env={"type": "custom", "cls": "tests.services.test_env_manager:HeldEnv"},
                episode={"sampling": {"max_new_tokens": 3, "temperature": 1.0}},
            )
            manager = build_loop(cfg, mesh.proxy_client, mesh.buffer_client, mesh.controller_client)
            await manager.start()
            for _ in range(400):  # the first group: member 0 done at v0, member 1 held in its step
                if any(s.finished_starts for s in manager._rolling.values()):
                    break
                await asyncio.sleep(0.025)
            [stale_gid] = list(manager._rolling)
            update_id = await mesh.controller_client.begin_update(1, timeout_s=60)
            await mesh.proxy_client.update_weights(tiny_model, 1)  # the trainer's push: the engine serves v1
            await mesh.controller_client.commit_update(update_id, 1, tiny_model)
            for _ in range(200):  # the watcher marks it before the held member returns
                if manager._rolling[stale_gid].stale:
                    break
                await asyncio.sleep(0.025)
            HeldEnv.held.set()
            for _ in range(400):  # its slot comes back: the next group is put at v1
                if manager.counters["groups_put"] >= 1:
                    break
                await asyncio.sleep(0.025)
            await manager.stop()
            batch = await mesh.buffer_client.get(10, version=1, max_staleness=0, timeout_s=1)
            return manager, stale_gid, batch.decode(), generate_latest(manager.observer.registry).decode()

    manager, stale_gid, groups, text = asyncio.run(main())
    assert manager.counters["groups_stale"] == 1 and manager.counters["groups_put"] >= 1, manager.counters
    assert stale_gid not in {g.group_id for g in groups} and groups  # never put; a fresh group was
    assert 'rollmesh_env_groups_total{result="stale"} 1.0' in text
    stale_tokens = float(text.split('rollmesh_env_stale_tokens_total{env="held"} ')[1].split()[0])
    assert 2 <= stale_tokens <= 2 * 3  # both members' generated tokens (1 to 3 each)


def test_a_generation_waits_out_an_unreachable_proxy_and_gives_up_at_its_deadline(engine_url, tiny_model):
    """Transient LLMProxy failures (here: nothing listening yet) are retried with backoff within
    the generation's deadline, and counted; bad input and a proxy that never comes back are not."""

    async def main():
        port = free_port()
        client = ProxyClient(f"127.0.0.1:{port}")
        loop = build_loop(EnvManagerConfig(tokenizer_path=tiny_model), client, None, None)
        retried = loop.observer.generate_retries.labels("UNAVAILABLE")
        # ignore_eos: a random model's sample can end early (it did: 1 run in about 50), and this is about retries
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        call = asyncio.ensure_future(loop.generate([1, 2, 3], params, "g/0", 30.0))
        await asyncio.sleep(1.0)  # the proxy comes up a second late
        server, proxy = await start_proxy(ProxyConfig(engine_urls=[engine_url], port=port, metrics_port=0))
        try:
            gen = await wait_for(call, 30)
            waited_out = retried._value.get()
            with pytest.raises(ValueError, match="input_ids"):  # not transient: raised at once
                await loop.generate([], SamplingParams(max_new_tokens=4), "g/1", 30.0)
            assert retried._value.get() == waited_out
        finally:
            await server.stop(0)
            await proxy.close()
        t0 = time.monotonic()
        with pytest.raises(TransientError) as gone:  # never comes back: raised at the deadline
            await loop.generate([1, 2, 3], SamplingParams(max_new_tokens=4), "g/2", 2.0)
        gave_up_after = time.monotonic() - t0
        await client.close()
        return gen, waited_out, gone.value.code, gave_up_after

    gen, waited_out, gone, gave_up_after = asyncio.run(main())
    assert len(gen.output_ids) == 4 and gen.finish_reason == "length"
    assert waited_out >= 1
    assert gone == "UNAVAILABLE" and 1.0 < gave_up_after < 4.0


def test_proxy_generate_maps_grpc_errors_to_the_projects_own():
    async def main():
        client = ProxyClient(f"127.0.0.1:{free_port()}")
        try:
            await ProxyGenerate(client).generate(
                [1], SamplingParams(max_new_tokens=1), request_id="r", route="r", timeout_s=0.5
            )
        finally:
            await client.close()

    with pytest.raises(TransientError) as e:
        asyncio.run(main())
    assert e.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_a_conversation_that_outgrows_the_context_ends_as_an_env_error_of_kind_context(engine_url, tiny_model):
    """The engine refuses a prompt that fills the model's context: the episode ends as env_error,
    kind ``context``, naming it (it was an exception in the log only)."""
    import asyncio

    from transformers import AutoTokenizer

    from rollout.episode import EpisodeConfig, run_episode
    from rollout.ports import FinishReason
    from rollout.sampling import SamplingParams
    from services.llm_proxy.client import ProxyGenerate
    from tests.services.mesh import local_mesh

    class Chatty:  # the second turn's observation is longer than any context here
        name = "chatty"

        def reset(self, seed):
            return "Say something."

        def step(self, action):
            from rollout.envs import StepResult

            return StepResult("and more " * 4000, 0.0, False)

    async def main():
        async with local_mesh(engine_url, tiny_model) as mesh:
            proxy = ProxyGenerate(mesh.proxy_client)

            async def generate(ids, sampling, trajectory_id, timeout_s):
                return await proxy.generate(
                    ids, sampling, request_id=trajectory_id, route=trajectory_id, timeout_s=timeout_s
                )

            config = EpisodeConfig(max_turns=3, sampling=SamplingParams(max_new_tokens=2))
            tok = AutoTokenizer.from_pretrained(tiny_model)
            return await run_episode(Chatty(), 0, generate, tok, config, trajectory_id="t", group_id="g", prompt_id="p")

    traj = asyncio.run(main())
    assert traj.finish_reason == FinishReason.ENV_ERROR and traj.metadata["error_kind"] == "context", traj.metadata
    assert "context" in traj.metadata["error"] and len(traj.behavior_logprobs) == 2  # the first turn stays


def test_a_domain_whose_reward_service_is_down_costs_its_own_scores_counted_by_domain(engine_url, tiny_model):
    """Two domains through the real EnvManager: 'graded' is scored by a reward service nobody serves
    (its address refuses), 'digits' by a function. The down service costs 'graded' its scores (0,
    counted as unreachable under its domain's label), and 'digits' goes on: its groups are put."""
    dead = f"127.0.0.1:{free_port()}"
    domains = [
        {"name": "digits", "dataset_path": EnvManagerConfig().dataset_path, "reward": "digit_answer"},
        {
            "name": "graded",
            "dataset_path": EnvManagerConfig().dataset_path,
            "reward": {"type": "service", "address": dead, "timeout_s": 2},
        },
    ]
    manager, groups, metrics, _ = asyncio.run(two_groups_with(engine_url, tiny_model, domains=domains))
    assert {g.domain for g in groups} <= {"digits", "graded"} and manager.counters["groups_put"] >= 2
    graded = [t.reward for g in groups if g.domain == "graded" for t in g.trajectories]
    assert all(r == 0.0 for r in graded)
    failures = float(
        metrics.split('rollmesh_env_domain_reward_failures_total{cause="unreachable",domain="graded"} ')[1].split()[0]
    )
    assert failures >= 1
    unlabelled = float(metrics.split('rollmesh_env_reward_failures_total{cause="unreachable"} ')[1].split()[0])
    assert unlabelled == failures  # the run's total: every domain's reward that counts its faults
    assert any(g.domain == "digits" for g in groups)  # the other domain went on
    assert 'rollmesh_env_domain_episodes_total{domain="graded",finish=' in metrics


def test_a_domain_on_an_environment_provider_beside_a_local_one(engine_url, tiny_model):
    """A remote domain (its episodes on a provider process, several turns) and a local single-turn one
    in one EnvManager: both domains' groups are put, each with its own turns, and the provider's pool
    is on the EnvManager's /metrics."""
    from services.processes import start_provider_process, stop_process

    proc, address, _ = start_provider_process("tests.services.provider_envs:ScriptEnv", ["step_timeout_s=1.0"])
    try:
        domains = [
            {
                "name": "tool",
                "env": {"type": "remote", "addresses": [address], "num_seeds": 10},
                "episode": {"max_turns": 2},
            },
            {"name": "digits", "dataset_path": EnvManagerConfig().dataset_path, "reward": "digit_answer"},
        ]
        _, groups, metrics, _ = asyncio.run(two_groups_with(engine_url, tiny_model, domains=domains))
    finally:
        stop_process(proc)
    assert {g.domain for g in groups} == {"tool", "digits"}
    turns = {g.domain: {len(t.metadata["turn_starts"]) for t in g.trajectories} for g in groups}
    assert turns["digits"] == {1} and max(turns["tool"]) <= 2
    assert "rollmesh_env_providers_up 1.0" in metrics


def test_a_users_workflow_runs_the_pools_episodes_and_its_failures_are_counted(engine_url, tiny_model):
    """env_manager.episode.workflow names a user's function: the EnvManager's episodes are that
    workflow's (two turns each, the critique between them), put as groups; one that raises ends its
    episodes as env_error of kind workflow, counted on /metrics, and the pool keeps serving."""
    fns = "tests.rollout.workflow_fns"
    episode = {"sampling": {"max_new_tokens": 3}, "workflow": {"type": "custom", "path": f"{fns}:retry_with_critique"}}
    manager, groups, _, requests = asyncio.run(two_groups_with(engine_url, tiny_model, episode=episode))
    assert manager.counters["groups_put"] >= 2
    for t in (t for g in groups for t in g.trajectories):
        assert len(t.metadata["turn_starts"]) == 2 and t.metadata["critique_turns"] == 1
        assert t.loss_mask.sum() == len(t.behavior_logprobs) > 0
    assert requests >= 2 * 2 * 2  # two generations an episode

    branching = {**episode, "workflow": {"type": "custom", "path": f"{fns}:branches"}}
    manager, groups, metrics, _ = asyncio.run(two_groups_with(engine_url, tiny_model, episode=branching))
    for g in groups:  # every member with its two sub-agents, each scored by the pool's own reward
        ids = [t.trajectory_id.removeprefix(f"{g.group_id}/") for t in g.trajectories]
        assert ids == ["0", "0.1", "0.2", "1", "1.1", "1.2"]
        assert all(t.loss_mask.sum() == len(t.behavior_logprobs) > 0 for t in g.trajectories)
    scored = next(line for line in metrics.splitlines() if line.startswith("rollmesh_env_reward_latency_seconds_count"))
    assert float(scored.split()[-1]) >= 3 * 2 * 2

    raising = {**episode, "workflow": {"type": "custom", "path": f"{fns}:raises"}}
    manager, _, metrics, _ = asyncio.run(
        two_groups_with(engine_url, tiny_model, until="groups_failed", episode=raising)
    )
    counters = manager.counters
    assert counters["groups_failed"] >= 2 and counters["groups_put"] == 0
    errors = next(
        line for line in metrics.splitlines() if line.startswith('rollmesh_env_errors_total{kind="workflow"}')
    )
    assert float(errors.split()[-1]) >= 4
