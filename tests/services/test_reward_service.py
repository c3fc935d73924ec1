"""The reward service: `rollmesh serve reward` as a real process on loopback, its client (the reward
an EnvManager, an environment provider or the held-out evaluation calls), verifiers that hang,
crash or raise, bad input, the token; and the LLM judge hosted there, scoring a held-out
evaluation through a real LLMProxy and engine."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

import grpc
import httpx
import pytest

from launch.config import ConfigError, load_config
from rollout.verifiers.service import ServiceRewardConfig
from services.auth import AuthConfig, grpc_sync_channel
from services.pb.rollmesh.v1 import reward_pb2 as pb
from services.processes import free_port, serve_command, start_service_process, stop_process
from services.reward.client import RewardClient
from tests.services.mesh import local_mesh
from tests.services.test_env_manager import two_groups_with


def start_reward_service(*overrides: str):
    """``rollmesh serve reward`` with ``reward_service.*`` overrides: (process, address, metrics URL)."""
    metrics_port = free_port()
    proc, address = start_service_process("reward", "reward_service", [f"metrics_port={metrics_port}", *overrides])
    return proc, address, f"http://127.0.0.1:{metrics_port}/metrics"


def call(address: str, method: str, request, token: str | None = None):
    """One raw call (the client never sends what these tests send)."""
    token = os.environ["ROLLMESH_TOKEN"] if token is None else token
    reply = {"Describe": pb.RewardDescribeResponse, "Score": pb.ScoreResponse}[method]
    with grpc_sync_channel(address, AuthConfig(disabled=True)) as ch:
        rpc = ch.unary_unary(
            f"/rollmesh.v1.RewardService/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=reply.FromString,
        )
        return rpc(request, timeout=30, metadata=(("authorization", f"Bearer {token}"),) if token else None)


def metric(url: str, name: str) -> float:
    line = next(x for x in httpx.get(url).text.splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


@pytest.fixture(scope="module")
def math_service():
    proc, address, metrics = start_reward_service("reward=math_verify", "workers=2", "max_chars=200")
    yield address, metrics
    stop_process(proc)


def test_math_verify_scores_free_form_answers_in_the_service(math_service):
    address, metrics = math_service
    client = RewardClient(address, timeout_s=20)
    assert client("The answer is 42.", "42") == 1.0
    assert client("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert client("41", "42") == 0.0  # wrong, not a fault
    assert sum(client.failures.values()) == 0 and client.calls == 3
    described = call(address, "Describe", pb.RewardDescribeRequest())
    assert described.reward == "math_verify" and described.timeout_s == 15.0
    assert metric(metrics, 'rollmesh_reward_scores_total{outcome="ok"}') == 3.0


@pytest.mark.parametrize(
    "request_, field",
    [
        (pb.ScoreRequest(response="1", answer="1", timeout_s=-1), "timeout_s"),
        (pb.ScoreRequest(response="1", answer="1", timeout_s=float("nan")), "timeout_s"),
        (pb.ScoreRequest(response="x" * 201, answer="1"), "response"),
        (pb.ScoreRequest(response="1", answer="y" * 201), "answer"),
    ],
)
def test_bad_input_is_refused_by_field_and_the_service_keeps_scoring(math_service, request_, field):
    address, _ = math_service
    with pytest.raises(grpc.RpcError) as e:
        call(address, "Score", request_)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field + ":")
    assert call(address, "Score", pb.ScoreRequest(response="7", answer="7")).reward == 1.0


@pytest.mark.parametrize("token", ["", "not-the-token"])
def test_a_call_without_the_token_is_refused(math_service, token):
    with pytest.raises(grpc.RpcError) as e:
        call(math_service[0], "Score", pb.ScoreRequest(response="7", answer="7"), token=token)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_verifier_that_hangs_crashes_or_raises_costs_one_score_and_the_service_keeps_serving():
    """A function reward runs in worker processes: a hang is cut at the service's timeout_s and its
    worker killed, a crash kills its worker, a raise is caught; each scores 0 with its cause, at the
    client and on the service's /metrics, and the next right answer scores 1. (5 s: a replaced
    worker's start, a spawned Python, counts against its first score.)"""
    proc, address, metrics = start_reward_service(
        "reward=tests.rollout.reward_fns:misbehave", "workers=2", "timeout_s=5"
    )
    try:
        client = RewardClient(address, timeout_s=10)
        assert client("warm", "warm") == 1.0  # the workers start on first use
        t0 = time.monotonic()
        assert client("hang", "x") == 0.0
        assert 4.5 < time.monotonic() - t0 < 8
        assert client("crash", "x") == 0.0
        assert client("raise", "x") == 0.0
        assert metric(metrics, 'rollmesh_reward_scores_total{outcome="raised"}') == 1.0
        assert [client(a, "right") for a in ("right", "wrong", "right")] == [1.0, 0.0, 1.0]
        assert (client.failures["timeout"], client.failures["crashed"], client.failures["raised"]) == (1, 1, 1)
        assert metric(metrics, 'rollmesh_reward_reward_failures_total{cause="crashed"}') == 1.0
        assert metric(metrics, 'rollmesh_reward_scores_total{outcome="ok"}') == 4.0
        assert metric(metrics, 'rollmesh_reward_scores_total{outcome="timeout"}') == 1.0
        assert metric(metrics, 'rollmesh_reward_scores_total{outcome="fault"}') == 1.0  # crashed
    finally:
        stop_process(proc)


def test_a_service_that_is_not_there_costs_the_score_within_its_timeout():
    client = RewardClient(f"127.0.0.1:{free_port()}", timeout_s=1.0)
    t0 = time.monotonic()
    assert client("7", "7") == 0.0
    assert 0.9 < time.monotonic() - t0 < 3.0 and client.failures["unreachable"] == 1


def test_a_client_waits_out_a_service_that_starts_late():
    """A restarted service is back within seconds: a score asked meanwhile comes once it is."""
    port = free_port()
    client = RewardClient(f"127.0.0.1:{port}", timeout_s=15.0)

    async def main():
        score = asyncio.create_task(asyncio.to_thread(client, "7", "7"))
        await asyncio.sleep(1.0)
        cmd = serve_command("reward", "reward_service", [f"port={port}", "metrics_port=0"])
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            return await score
        finally:
            stop_process(proc)

    assert asyncio.run(main()) == 1.0 and sum(client.failures.values()) == 0


def test_the_env_manager_scores_its_episodes_in_the_reward_service(engine_url, tiny_model):
    """reward: {type: service}: every episode's reward comes from the service (a reward of the answer's
    length here, so a random model's answers differ; in the service's worker processes), exactly, and
    the EnvManager counts no failure."""
    proc, address, metrics = start_reward_service("reward=tests.rollout.reward_fns:length_share")
    try:
        reward = {"type": "service", "address": address}
        manager, groups, text, _ = asyncio.run(two_groups_with(engine_url, tiny_model, reward=reward))
        scored = metric(metrics, 'rollmesh_reward_scores_total{outcome="ok"}')
    finally:
        stop_process(proc)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert len(groups) == 2 and scored >= manager.counters["trajectories_put"] == 4
    for g in groups:
        for t in g.trajectories:
            said = tok.decode(t.token_ids.tolist()[-int(t.loss_mask.sum()) :], skip_special_tokens=True)
            assert t.reward == len(said) / 100
    assert any(t.reward > 0 for g in groups for t in g.trajectories)  # a value, not float32's approximation of it
    assert 'rollmesh_env_reward_failures_total{cause="unreachable"} 0.0' in text


def test_a_judge_hosted_in_the_reward_service_scores_a_heldout_evaluation(engine_url, tiny_model, tmp_path):
    """The judge cannot run in a held-out evaluation (or an environment provider): no LLMProxy there.
    Hosted in the reward service, it scores the evaluation's answers through the mesh's proxy: one
    judge generation per answer. (The tiny model's verdicts are noise: the pattern takes any text as
    the verdict '', worth 1, so every answer the judge gave a verdict on counts as right.)"""
    from launch.evaluation import heldout_accuracy
    from services.grpc_util import start_server
    from services.reward.ports import reward_ports
    from services.reward.server import RewardService, build_handler, hosted_reward

    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\n' for i in range(6)))
    judge = (
        '{type: judge, template: "{answer} {response} Verdict:", verdict_pattern: "()", scores: {"": 1.0}, '
        "max_new_tokens: 2, timeout_s: 20}"
    )
    cfg = load_config(
        None,
        [
            f"model_path={tiny_model}",
            f"run.heldout_path={heldout}",
            f"reward_service.reward={judge}",
            "env_manager.reward={type: service, timeout_s: 25}",
            "env_manager.episode.sampling.max_new_tokens=2",
        ],
    )
    # A judge in the evaluation itself is refused, naming the way out.
    with pytest.raises(ValueError, match="rollmesh serve reward"):
        from rollout.rewards import build_reward

        build_reward(load_config(None, [f"env_manager.reward={judge}"]).env_manager.reward)

    async def main():
        async with local_mesh(engine_url, tiny_model) as mesh:
            ports = reward_ports(cfg.auth, proxy=mesh.proxy_client, tokenizer_path=tiny_model)
            service = RewardService(cfg.reward_service, hosted_reward(cfg.reward_service, ports))
            server = await start_server(build_handler(service), "rollmesh.v1.RewardService", "127.0.0.1", 0)
            cfg.mesh.reward = f"127.0.0.1:{server.bound_port}"
            requests0 = mesh.proxy.counters["requests"]
            try:
                held = await heldout_accuracy(mesh.proxy_client.address, cfg)
            finally:
                await server.stop(0)
            return held, service.reward.calls, mesh.proxy.counters["requests"] - requests0

    held, judged, requests = asyncio.run(main())
    assert held.unanswered == 0 and held.accuracy == 1.0
    assert judged == 6 and requests == 12  # six answers, six verdicts


def test_the_config_refuses_a_service_scoring_through_another_and_workers_in_front_of_one():
    with pytest.raises(ConfigError, match="reward_service.reward"):
        load_config(None, ["reward_service.reward={type: service}"])
    with pytest.raises(ConfigError, match="reward_workers.workers"):
        load_config(None, ["env_manager.reward={type: service}", "env_manager.reward_workers.workers=2"])
    with pytest.raises(ConfigError, match="step_timeout_s"):
        load_config(None, ["env_manager.reward={type: service, timeout_s: 60}"])
    # The mesh's own service may take longer than its client waits: refused at load.
    with pytest.raises(ConfigError, match="reward_service.timeout_s"):
        load_config(None, ["env_manager.reward={type: service}", "reward_service.reward={type: judge}"])
    load_config(None, ["env_manager.reward={type: service, timeout_s: 25}", "reward_service.reward={type: judge}"])
    cfg = load_config(None, ["reward_service.reward={type: code}"])
    assert cfg.reward_service.timeout_s == cfg.reward_service.reward.max_seconds()  # the reward's own bound
    assert ServiceRewardConfig().max_seconds() < load_config(None).env_manager.episode.step_timeout_s


def test_an_environment_provider_scores_its_episodes_in_the_reward_service(math_service, tmp_path):
    from services.env_provider.config import EnvProviderConfig
    from services.env_provider.server import build_sessions

    data = tmp_path / "task.jsonl"
    data.write_text('{"prompt": "What is 6 x 7?", "answer": "42"}\n')
    config = EnvProviderConfig(dataset_path=str(data), reward={"type": "service", "address": math_service[0]})
    sessions = build_sessions(config, AuthConfig())

    async def main():
        await sessions.reset("e1", seed=0)
        await sessions.reset("e2", seed=0)
        return await sessions.step("e1", "It is 42."), await sessions.step("e2", "41")

    right, wrong = asyncio.run(main())
    assert (right.reward, right.done, wrong.reward, wrong.done) == (1.0, True, 0.0, True)
