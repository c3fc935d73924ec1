"""Environment providers over real processes on loopback: rollmesh's provider server (gRPC and
HTTP at once) driven by the EnvManager's clients over gRPC, REST and OpenEnv's WebSocket; a
server written with openenv-core alone; faults (a provider killed mid-episode, one whose
environment hangs, raises or answers garbage); the token on every route."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import aiohttp
import grpc
import httpx
import pytest

# Imported at collection, not inside the test: deep in a long pytest session, compiling this
# import chain (beartype rewrites fastmcp's modules) once raised CPython 3.11's "AST constructor
# recursion depth mismatch" SystemError; alone it passes.
from openenv.core import GenericEnvClient  # isort: skip

from rollout.budgets import Budgets
from rollout.envs.base import Observation
from rollout.envs.remote import PROTOCOLS, ProviderError, ProviderTimeout, RemoteEnv, RemoteEnvConfig
from sample_buffer.deadlines import wait_for
from services.auth import AuthConfig
from services.env_provider.clients import build_pool
from services.pb.rollmesh.v1 import env_provider_pb2 as pb
from services.pb.rollmesh.v1 import env_provider_pb2_grpc as pb_grpc
from services.processes import free_port, start_provider_process, stop_process, wait_http_healthy

SCRIPT = "tests.services.provider_envs:ScriptEnv"
PNG_BYTES = bytes.fromhex(  # a 1×1 PNG
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
)
FAST = ["step_timeout_s=1.0"]  # a hanging step is answered as a timeout after 1 s


def headers(token: str | None = None) -> dict:
    token = token or os.environ["ROLLMESH_PROVIDER_TOKEN"]
    return {"authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def provider():
    proc, address, url = start_provider_process(SCRIPT, FAST)
    yield {"grpc": address, "http": url, "openenv": url}
    stop_process(proc)


def pool_for(protocol: str, addresses: list[str], **cfg):
    return build_pool(RemoteEnvConfig(protocol=protocol, addresses=addresses, **cfg), AuthConfig())


def sessions_open(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("rollmesh_provider_sessions")))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_multi_turn_episode_over_each_protocol(provider, protocol):
    async def main():
        pool = pool_for(protocol, [provider[protocol]])
        env = RemoteEnv(pool, f"episode-{protocol}")
        try:
            first = await env.reset(3)
            budgets = env.budgets
            steps = [await env.step(a) for a in ("a", "b", "7")]
            open_during = sessions_open(provider["http"])
            await env.close()
        finally:
            await pool.aclose()
        return first, steps, open_during, budgets

    first, (s1, s2, s3), open_during, budgets = asyncio.run(main())
    assert first == "start 3"
    assert budgets == Budgets(step_s=5.0, generation_tokens=64)  # as the hosted environment declares them
    assert (s1.observation, s1.role, s1.reward, s1.done) == ("echo a", "tool", pytest.approx(0.1), False)
    assert s2.observation == "echo b"
    assert (s3.observation, s3.reward, s3.done, s3.info) == (None, 1.0, True, {"steps": 3})
    assert open_during >= 1 and sessions_open(provider["http"]) == 0  # closed with the episode


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_pictures_reach_the_episode_over_each_protocol(protocol):
    from tests.services.provider_envs import PictureEnv

    proc, address, url = start_provider_process("tests.services.provider_envs:PictureEnv")

    async def main():
        pool = pool_for(protocol, [address if protocol == "grpc" else url])
        env = RemoteEnv(pool, f"pictures-{protocol}")
        try:
            first = await env.reset(3)
            more = await env.step("more")
            last = await env.step("4")
            await env.close()
        finally:
            await pool.aclose()
        return first, more, last

    try:
        first, more, last = asyncio.run(main())
    finally:
        stop_process(proc)
    assert isinstance(first, Observation) and first == Observation("Which digit?", (PictureEnv.picture(3),))
    assert more.observation == Observation("And this one?", (PictureEnv.picture(4),)) and not more.done
    assert (last.observation, last.reward, last.done) == (None, 1.0, True)


def test_an_http_observations_images_are_data_urls_and_bounded():
    from sample_buffer.vision import MAX_IMAGES, data_url
    from services.env_provider.clients import HttpProviderClient

    client = HttpProviderClient("http://127.0.0.1:1", RemoteEnvConfig(addresses=["http://127.0.0.1:1"]), AuthConfig())
    png = PNG_BYTES

    def observed(images):
        return client._observation({"observation": {"content": "look", "images": images}, "done": False})

    assert observed(data_url(png)).images == observed([data_url(png)]).images == (png,)
    assert observed(None).images == ()
    for bad, why in [
        (["https://example.com/digit.png"], "URLs are refused"),
        ([data_url(png)] * (MAX_IMAGES + 1), f"at most {MAX_IMAGES}"),
        ({"url": data_url(png)}, "a data URL or a list"),
        (["data:text/plain;base64,aGk="], "data URL must be data:image/"),
    ]:
        with pytest.raises(ProviderError, match=why) as e:
            observed(bad)
        assert e.value.kind == "observation"


def test_every_route_but_health_needs_the_token(provider, monkeypatch):
    """The provider's own token: no token, a wrong one and the mesh's own (data or control) are refused."""
    url = provider["http"]
    assert httpx.get(url + "/health").status_code == 200
    mesh_tokens = [os.environ["ROLLMESH_TOKEN"], os.environ["ROLLMESH_CONTROL_TOKEN"]]
    for token in (None, "wrong", *mesh_tokens):
        h = headers(token) if token else {}
        r = httpx.post(url + "/reset", json={"seed": 1}, headers=h)
        assert r.status_code == 401 and r.json()["field"] == "authorization"
        assert httpx.get(url + "/metadata", headers=h).status_code == 401

    async def ws_without_token():
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await s.ws_connect(url + "/ws")
            return e.value.status

    assert asyncio.run(ws_without_token()) == 403

    async def grpc_without_token():
        async with grpc.aio.insecure_channel(provider["grpc"]) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await pb_grpc.EnvProviderStub(ch).Describe(pb.DescribeRequest(), timeout=5)
            return e.value.code()

    assert asyncio.run(grpc_without_token()) == grpc.StatusCode.UNAUTHENTICATED

    monkeypatch.setenv("WRONG_PROVIDER_TOKEN", os.environ["ROLLMESH_TOKEN"])  # the mesh's data token

    async def client_with_a_wrong_token(protocol):
        config = RemoteEnvConfig(protocol=protocol, addresses=[provider[protocol]], token_env="WRONG_PROVIDER_TOKEN")
        pool = build_pool(config, AuthConfig())
        try:
            with pytest.raises(ProviderError) as e:
                await wait_for(RemoteEnv(pool, "e").reset(0, timeout_s=5), 10)
            return e.value.kind
        finally:
            await pool.aclose()

    for protocol in PROTOCOLS:  # refused at once, not retried as if the provider were down
        assert asyncio.run(client_with_a_wrong_token(protocol)) == "refused"


def test_bad_requests_are_named_and_the_provider_keeps_serving(provider):
    url, h = provider["http"], headers()
    r = httpx.post(url + "/reset", json={"seed": 0, "episode_id": "bad-1"}, headers=h)
    assert r.status_code == 200 and r.json()["observation"] == {"content": "start 0", "role": "user"}

    def step(body, raw=None):
        if raw is not None:
            return httpx.post(url + "/step", content=raw, headers={**h, "content-type": "application/json"})
        return httpx.post(url + "/step", json=body, headers=h)

    cases = [
        (step({"episode_id": "bad-1", "action": {"content": "x" * 70_000}}), 400, "action"),
        (step({"action": {"content": "hi"}}), 400, "episode_id"),
        (step({"episode_id": "nobody", "action": {"content": "hi"}}), 404, "episode_id"),
        (step({"episode_id": "bad-1", "action": ["hi"]}), 400, "action"),
        (step({"episode_id": "bad-1", "action": {"content": "hi"}, "timeout_s": -1}), 400, "timeout_s"),
        (step(None, raw=b"{not json"), 400, "body"),
        (step(None, raw=b'{"episode_id": "bad-1", "action": {"content": "\xff\xfe"}}'), 400, "body"),
        (httpx.post(url + "/reset", json={"seed": -1}, headers=h), 400, "seed"),
        (httpx.post(url + "/reset", json={"episode_id": "e" * 300}, headers=h), 400, "episode_id"),
    ]
    for response, status, field in cases:
        assert (response.status_code, response.json()["field"]) == (status, field), response.text
        assert response.json()["message"].startswith(field + ":")

    async def grpc_errors():
        from services.auth import PROVIDER_TOKEN_ENV, provider_auth
        from services.grpc_util import channel

        auth = provider_auth(AuthConfig(), PROVIDER_TOKEN_ENV)

        async with channel(provider["grpc"], auth=auth) as ch:
            stub, out = pb_grpc.EnvProviderStub(ch), []
            for call in (
                stub.Reset(pb.ResetRequest(seed=1), timeout=5),
                stub.Step(pb.StepRequest(episode_id="bad-1", action="x" * 70_000), timeout=5),
                stub.Step(pb.StepRequest(episode_id="nobody", action="a"), timeout=5),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                out.append((e.value.code(), e.value.details().split(":")[0]))
            return out

    assert asyncio.run(grpc_errors()) == [
        (grpc.StatusCode.INVALID_ARGUMENT, "episode_id"),
        (grpc.StatusCode.INVALID_ARGUMENT, "action"),
        (grpc.StatusCode.NOT_FOUND, "episode_id"),
    ]

    async def ws_errors():
        async with aiohttp.ClientSession(headers=h) as s, s.ws_connect(url + "/ws") as ws:
            out = []
            for msg in (
                "{oops",
                json.dumps({"type": "jump"}),
                json.dumps({"type": "step", "data": {"content": 3}}),
                json.dumps({"type": "reset", "data": {"seed": 4}}),
            ):
                await ws.send_str(msg)
                out.append(json.loads((await ws.receive(timeout=5)).data))
            return out

    bad_json, unknown, bad_content, reset = asyncio.run(ws_errors())
    assert bad_json["type"] == "error" and bad_json["data"]["code"] == "INVALID_JSON"
    assert unknown["type"] == "error" and unknown["data"]["field"] == "type"
    assert bad_content["type"] == "error" and bad_content["data"]["field"] == "data.content"
    assert reset == {
        "type": "observation",
        "data": {"observation": {"content": "start 4", "role": "user"}, "reward": None, "done": False},
    }
    # still serving: the step the bad ones did not spoil
    r = step({"episode_id": "bad-1", "action": {"content": "ok"}, "request_id": "r1"})
    assert r.status_code == 200 and r.json()["observation"]["content"] == "echo ok"
    again = step({"episode_id": "bad-1", "action": {"content": "ok"}, "request_id": "r1"})  # a retried step
    assert again.json() == r.json()
    assert httpx.get(url + "/state", params={"episode_id": "bad-1"}, headers=h).json()["step_count"] == 1
    assert httpx.post(url + "/close", json={"episode_id": "bad-1"}, headers=h).json() == {"closed": True}
    assert httpx.get(url + "/state", params={"episode_id": "bad-1"}, headers=h).status_code == 404


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_environment_faults_end_the_episode_with_their_kind(provider, protocol):
    async def fault(action: str):
        pool = pool_for(protocol, [provider[protocol]], max_observation_chars=100_000)
        env = RemoteEnv(pool, f"fault-{protocol}-{action}")
        try:
            await env.reset(0)
            try:
                await env.step(action, timeout_s=10)
            except (ProviderError, TimeoutError) as e:
                return type(e), getattr(e, "kind", None), str(e), pool.members[0].up
            finally:
                await env.close()
        finally:
            await pool.aclose()
        raise AssertionError(f"{action}: no error")

    raised = asyncio.run(fault("raise"))
    assert raised[:2] == (ProviderError, "refused") and "ValueError" in raised[2] and raised[3]  # still in rotation
    huge = asyncio.run(fault("huge"))
    assert huge[1] == "observation" and "max_observation_chars" in huge[2]
    assert asyncio.run(fault("empty"))[1] == "observation"
    number = asyncio.run(fault("number"))
    assert number[1] == "refused" and "not text" in number[2]
    hang = asyncio.run(fault("hang"))  # the provider's 1 s step deadline: a timeout, the provider stays up
    assert hang[0] is ProviderTimeout and hang[3]


def test_garbage_answers_take_a_provider_out_of_rotation():
    """A server that answers 200 with something that is not OpenEnv's contract."""
    from aiohttp import web

    async def main():
        async def metadata(_):
            return web.json_response({"name": "g", "idempotent_steps": True})

        async def reset(_):
            return web.Response(body=b"\xff\xfe not json", status=200)

        app = web.Application()
        app.router.add_get("/metadata", metadata)
        app.router.add_post("/reset", reset)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        pool = pool_for("http", [f"http://127.0.0.1:{port}"])
        try:
            with pytest.raises(ProviderError) as e:
                await RemoteEnv(pool, "g1").reset(0, timeout_s=0.5)
            return e.value.kind, pool.members[0].up, pool.counters
        finally:
            await pool.aclose()
            await runner.cleanup()

    kind, up, counters = asyncio.run(main())
    assert kind == "unreachable" and not up  # the reset ran out of providers to try: the last error says so
    assert counters["failed_garbage"] >= 1 and counters["marked_down"] == 1


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_provider_killed_mid_episode_is_used_again_once_back(protocol):
    proc, address, url = start_provider_process(SCRIPT, FAST)
    grpc_port, http_port = int(address.rsplit(":", 1)[1]), int(url.rsplit(":", 1)[1])

    async def main():
        pool = pool_for(protocol, [address if protocol == "grpc" else url], health_interval_s=0.2)
        try:
            env = RemoteEnv(pool, "killed")
            await env.reset(1)
            assert (await env.step("a")).observation == "echo a"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            with pytest.raises(ProviderError) as e:
                await env.step("b", timeout_s=10)
            await env.close()
            assert e.value.kind == "unreachable" and not pool.members[0].up
            # back on the same ports: a new episode finds it again by its health check
            restarted = await asyncio.to_thread(start_provider_process, SCRIPT, FAST, grpc_port, http_port)
            try:
                fresh = RemoteEnv(pool, "after-restart")
                first = await fresh.reset(2, timeout_s=20)
                await fresh.close()
            finally:
                stop_process(restarted[0])
            return first, dict(pool.counters)
        finally:
            await pool.aclose()

    try:
        first, counters = asyncio.run(main())
    finally:
        stop_process(proc)
    assert first == "start 2"
    assert counters["marked_down"] == 1 and counters["back_up"] == 1
    assert counters["failed_unreachable"] == 3  # the step, then its two retries (the provider dedupes steps)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_step_in_flight_when_its_provider_dies_fails_as_unreachable_not_as_a_timeout(protocol):
    """The provider killed while it works on a step: the connection's end is the answer, counted
    as unreachable (an env error of the provider's), not waited out as the step's timeout."""
    proc, address, url = start_provider_process(SCRIPT, FAST)

    async def main():
        pool = pool_for(protocol, [address if protocol == "grpc" else url], step_retries=0)
        try:
            env = RemoteEnv(pool, "dies")
            await env.reset(1)
            step = asyncio.create_task(env.step("hang", timeout_s=60))
            await asyncio.sleep(0.5)  # the provider is in the step
            os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises(ProviderError) as e:
                await step
            await env.close()
            return e.value, dict(pool.counters)
        finally:
            await pool.aclose()

    try:
        error, counters = asyncio.run(main())
    finally:
        stop_process(proc)
    assert error.kind == "unreachable" and not isinstance(error, TimeoutError), error
    assert counters.get("failed_unreachable") == 1 and "failed_no_answer" not in counters, counters


def test_an_episode_with_no_provider_up_is_the_providers_error_not_a_timeout():
    """Every provider down for the whole reset deadline: the episode ends as env_error of kind
    unreachable (counted among the environment's errors), not as the episode's own timeout."""
    from rollout.episode import EpisodeConfig, run_episode
    from rollout.ports import FinishReason
    from rollout.sampling import SamplingParams

    async def never(*args):
        raise AssertionError("no generation without an episode")

    async def main():
        pool = pool_for("grpc", [f"127.0.0.1:{free_port()}"], health_interval_s=0.2)
        try:
            config = EpisodeConfig(step_timeout_s=1.0, sampling=SamplingParams(max_new_tokens=2))
            env = RemoteEnv(pool, "nobody")
            return await run_episode(env, 0, never, None, config, trajectory_id="t", group_id="g", prompt_id="p")
        finally:
            await pool.aclose()

    traj = asyncio.run(main())
    assert traj.finish_reason == FinishReason.ENV_ERROR and traj.metadata["error_kind"] == "unreachable", traj.metadata


def test_resets_go_to_the_providers_that_are_up(provider):
    async def main():
        dead = f"127.0.0.1:{free_port()}"
        pool = pool_for("grpc", [dead, provider["grpc"]])
        try:
            envs = [RemoteEnv(pool, f"spread-{i}") for i in range(6)]
            firsts = [await e.reset(i, timeout_s=10) for i, e in enumerate(envs)]
            loads = [m.episodes for m in pool.members]
            for e in envs:
                await e.close()
            return firsts, loads, pool.members[0].up
        finally:
            await pool.aclose()

    firsts, loads, dead_up = asyncio.run(main())
    assert firsts == [f"start {i}" for i in range(6)]
    assert loads == [0, 6] and not dead_up


def _uvicorn_factory(factory: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "uvicorn", "--factory", factory, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_healthy(url + "/health", 60, proc)
    except BaseException:
        stop_process(proc)
        raise
    return proc, url


def test_an_openenv_server_plugs_in_unchanged():
    """A server written with openenv-core alone (its own field names), driven over its WebSocket."""
    proc, url = _uvicorn_factory("tests.services.provider_envs:openenv_app")
    try:

        async def main():
            pool = pool_for("openenv", [url], action_key="guess", observation_key="message")
            try:
                env = RemoteEnv(pool, "guess")
                first = await env.reset(2)  # the target is 3
                steps = [await env.step(g) for g in ("1", "3")]
                await env.close()
                return first, steps
            finally:
                await pool.aclose()

        first, (low, right) = asyncio.run(main())
    finally:
        stop_process(proc)
    assert first == "Guess a number from 1 to 4."
    assert (low.observation, low.reward, low.done) == ("No, higher.", 0.0, False)
    assert (right.reward, right.done) == (1.0, True)


def test_an_openenv_server_of_one_session_and_null_last_fields_serves_every_episode_in_turn():
    """OpenEnv's own shapes: at capacity it answers CAPACITY_REACHED, and the episode waits for the
    session (busy, not a failure); the last observation's text field is null with done."""
    proc, url = _uvicorn_factory("tests.services.provider_envs:openenv_one_session_app")
    try:

        async def episode(pool, seed: int):
            env = RemoteEnv(pool, f"sum-{seed}")
            try:
                question = await env.reset(seed, timeout_s=60)
                return question, await env.step(str(2 + seed))
            finally:
                await env.close()

        async def main():
            pool = pool_for("openenv", [url], action_key="answer", observation_key="question")
            try:
                results = await asyncio.gather(*(episode(pool, s) for s in range(3)))
                # One holds the session past another's whole reset deadline: that one ends busy, and
                # the provider (which answered every time) stays in rotation.
                holder = RemoteEnv(pool, "holder")
                await holder.reset(0, timeout_s=30)
                with pytest.raises(ProviderError) as late:
                    await RemoteEnv(pool, "late").reset(1, timeout_s=1.0)
                await holder.close()
                return results, dict(pool.counters), late.value.kind, pool.members[0].up
            finally:
                await pool.aclose()

        results, counters, late, up = asyncio.run(main())
    finally:
        stop_process(proc)
    assert [q for q, _ in results] == [f"What is 2 + {s}?" for s in range(3)]
    assert all((r.observation, r.reward, r.done) == (None, 1.0, True) for _, r in results), results
    assert counters.get("failed_busy", 0) >= 1, counters  # they queued for the one session
    assert late == "busy" and up, (late, counters)
    assert not {"marked_down", "failed_garbage", "failed_unreachable", "failed_refused"} & set(counters), counters


def test_an_openenv_servers_feedback_in_its_messages_reaches_the_model():
    """textarena_env's shape: rules in `prompt`, feedback in `messages`. The first field that holds
    text, of [messages, prompt], shows the rules first and the feedback after; a formatter
    (`module:function`) can say it otherwise."""
    proc, url = _uvicorn_factory("tests.services.provider_envs:openenv_feedback_app")
    try:

        async def play(**mapping):
            pool = pool_for("openenv", [url], action_key="message", **mapping)
            try:
                env = RemoteEnv(pool, "feedback")
                first = await env.reset(2)  # the target is 3
                low, right = await env.step("[1]"), await env.step("[3]")
                await env.close()
                return first, low, right
            finally:
                await pool.aclose()

        listed = asyncio.run(play(observation_key=["messages", "prompt"]))
        formatted = asyncio.run(play(observation_format="tests.services.provider_envs:game_text"))
        with pytest.raises(ValueError, match="observation_format: cannot import 'tests.services.provider_envs:nope'"):
            pool_for("openenv", [url], observation_format="tests.services.provider_envs:nope")

        async def not_text():  # a formatter answering something else: the episode's fault, not the provider's
            pool = pool_for("openenv", [url], action_key="message", observation_format="builtins:len")
            try:
                with pytest.raises(ProviderError) as e:
                    await RemoteEnv(pool, "len").reset(0, timeout_s=5)
                return e.value.kind, pool.members[0].up
            finally:
                await pool.aclose()

        assert asyncio.run(not_text()) == ("observation", True)
    finally:
        stop_process(proc)
    first, low, right = listed
    assert first == "Guess a number from 1 to 4 in [brackets]."
    assert low.observation == "You guessed 1.\nHigher." and (right.reward, right.done) == (1.0, True)
    assert [formatted[0], formatted[1].observation] == ["Guess a number from 1 to 4 in [brackets].", "Higher."]


def test_openenvs_own_client_drives_a_rollmesh_provider():
    """The other way round: OpenEnv's GenericEnvClient (it sends no token: auth off on this one)."""
    proc, _, url = start_provider_process(SCRIPT, ["auth.disabled=true"])

    async def main():
        async with GenericEnvClient(base_url=url) as env:
            first = await env.reset(seed=5)
            step = await env.step({"content": "hello"})
            return first, step

    try:
        first, step = asyncio.run(main())
    finally:
        stop_process(proc)
    assert first.observation["content"] == "start 5" and not first.done
    assert step.observation == {"content": "echo hello", "role": "tool"} and step.reward == pytest.approx(0.1)


def loop_on_providers(env: dict, reply, group_size: int, episode: dict | None = None, groups: int = 2):
    """Run the rollout loop (the plain controller, the in-memory buffer, a scripted engine answering
    ``reply(request id)``) with episodes on the providers ``env`` names, until ``groups`` are put;
    returns (loop, controller, pool, the groups put)."""
    import functools

    from rollout.config import RolloutConfig
    from rollout.loop import RolloutLoop
    from sample_buffer.config import BufferConfig
    from sample_buffer.memory import MemoryBuffer
    from services.controller.config import ControllerConfig
    from services.controller.controller import AsyncController
    from tests.rollout.test_loop import CharTokenizer, Recorder, ScriptedEngine, until

    async def main():
        controller = AsyncController(ControllerConfig(async_ratio=0, groups_per_step=groups))
        buffer = MemoryBuffer(BufferConfig())
        engine = ScriptedEngine(controller, reply=reply)
        config = RolloutConfig(group_size=group_size, num_workers=2, env=env, episode=episode or {}, admit_poll_s=0.005)
        pool = build_pool(config.env, AuthConfig())
        loop = RolloutLoop(
            config,
            rows=[{}] * 10,
            tokenizer=CharTokenizer(),
            reward_fn=None,
            admission=controller,
            engine=engine,
            sink=buffer,
            observer=Recorder(),
            make_env=functools.partial(RemoteEnv, pool),
        )
        try:
            await loop.start()
            await until(lambda: loop.counters["groups_put"] >= groups, 20)
            await loop.stop()
        finally:
            await pool.aclose()
        batch = await buffer.get(10, version=0, max_staleness=0, timeout_s=0)
        return loop, controller, pool, batch.decode()

    return asyncio.run(main())


def test_the_rollout_loop_runs_multi_turn_episodes_on_a_provider(provider):
    """The loop over the plain controller and the in-memory buffer, its episodes on a provider
    process: one member of each group makes its environment raise; it is left out, counted by
    kind, and the groups (two members each) are put with every slot accounted for."""
    from sample_buffer.trajectory import FinishReason
    from tests.rollout.test_loop import CharTokenizer

    env = {"type": "remote", "addresses": [provider["grpc"]], "num_seeds": 10}
    reply = lambda rid: {"0": "7", "1": "raise", "2": "8"}[rid[-1]]  # noqa: E731
    loop, controller, _, groups = loop_on_providers(env, reply, group_size=3, episode={"max_turns": 4})
    assert len(groups) == 2 and controller.in_flight == 0 and controller.finished == 2
    assert loop.counters["members_dropped_env_error"] == 2 and loop.observer.dropped == ["env_error"] * 2
    for g in groups:
        assert [t.trajectory_id.rsplit("/", 1)[1] for t in g.trajectories] == ["0", "2"]
        for t, answer, reward in zip(g.trajectories, "78", (1.2, 0.2)):  # 0.1 + 0.1 + (1.0 for a final "7")
            assert t.finish_reason == FinishReason.STOP and t.reward == pytest.approx(reward)
            assert t.metadata["turn_starts"] == [7, 14, 21]  # three generations, two tool results between them
            a = answer
            assert CharTokenizer().decode(t.token_ids) == f"start {t.prompt_id[1:]}{a}echo {a}{a}echo {a}{a}"
            assert list(t.loss_mask) == [0] * 7 + [1] + [0] * 6 + [1] + [0] * 6 + [1]
    assert sessions_open(provider["http"]) == 0  # every episode closed on the provider, the failed ones too


def test_an_openenv_episode_survives_a_long_generation_between_steps():
    """The policy may think for minutes between two steps; the WebSocket's keepalive must not end
    the episode meanwhile (the server pings every 0.3 s here and drops a client silent for 0.6 s)."""
    proc, _, url = start_provider_process(SCRIPT, [*FAST, "ws_ping_interval_s=0.3"])

    async def main():
        pool = pool_for("openenv", [url])
        env = RemoteEnv(pool, "a-slow-policy")
        try:
            await env.reset(1)
            await asyncio.sleep(2.0)  # generating, reading nothing
            step = await env.step("a")
            await env.close()
        finally:
            await pool.aclose()
        return step

    try:
        assert asyncio.run(main()).observation == "echo a"
    finally:
        stop_process(proc)
