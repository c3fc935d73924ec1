"""Two training runs on one LLMProxy and its engines (``proxy.runs``, rollout/proxy/lanes.py), over
real gRPC and two real embedded engine processes: each run's requests are served with its own LoRA
adapter at its own version, a run's suspend stops its requests only, and a run's tokens reach
nothing of another run's nor the engines' base weights."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import grpc
import pytest
from pydantic import SecretStr

from rollout.proxy import ProxyConfig
from rollout.sampling import SamplingParams
from services.auth import AuthConfig, AuthError, RunTokens
from services.llm_proxy.client import ProxyClient, generate_request
from services.llm_proxy.server import start_proxy
from services.pb.rollmesh.v1 import common_pb2
from services.pb.rollmesh.v1 import llm_proxy_pb2 as pb
from services.processes import start_engine_process, stop_process
from tests.engines import TEST_LOAD_ROOTS
from tests.rollout.test_engine_lora import PROMPTS, _adapter, _greedy

RUNS = {"math": ("RM_TEST_MATH_TOKEN", "RM_TEST_MATH_CONTROL"), "code": ("RM_TEST_CODE_TOKEN", "RM_TEST_CODE_CONTROL")}
N = 12  # what _greedy generates


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("shared_adapters")
    return {name: (root / name, _adapter(tiny_model, root / name, seed)) for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture
def both(adapters) -> dict[str, str]:
    """Both runs may load both adapters."""
    root = adapters["a"][0].parent
    return {"math": root, "code": root}


async def loaded(urls) -> list[list[str]]:
    """The adapters each engine lists."""
    from services.llm_proxy.server import engine_client

    clients = [engine_client(u, api=getattr(urls, "api", "sglang")) for u in urls]
    try:
        return [sorted(await c.lora_adapters()) for c in clients]
    finally:
        await asyncio.gather(*(c.close() for c in clients))


def serving(proxy) -> list[str]:
    return sorted(lane.adapter for lane in proxy.lanes.values() if lane.adapter is not None)


async def in_flight(proxy, run: str, rid: str) -> None:
    """Until ``run``'s request ``rid`` is at an engine, plus a few tokens' time."""
    for _ in range(3000):
        fl = proxy.in_flight.get((run, rid))
        if fl is not None and fl.slot is not None:
            await asyncio.sleep(0.05)
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{run}'s request {rid} never reached an engine")


@pytest.fixture(scope="module")
def pool(tiny_model, engine_pool):
    with engine_pool.borrowed(tiny_model, TEST_LOAD_ROOTS, 2) as urls:
        yield urls


@pytest.fixture(params=["embedded", "vllm"])
def either_pool(request):
    """The runs' first test runs on the embedded engines and on vLLM's (the session's)."""
    return request.getfixturevalue({"embedded": "pool", "vllm": "vllm_engines"}[request.param])


@pytest.fixture
def run_tokens(monkeypatch) -> dict[str, AuthConfig]:
    """Each run's tokens in the proxy's environment; each run's own auth (what its mesh holds)."""
    out = {}
    for name, (data_env, control_env) in RUNS.items():
        data, control = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
        monkeypatch.setenv(data_env, data)
        monkeypatch.setenv(control_env, control)
        out[name] = AuthConfig(token=SecretStr(data), control_token=SecretStr(control))
    return out


def shared(roots: dict[str, str]) -> dict:
    """``proxy.runs``: math and code, their tokens' variables and adapter folders."""
    return {n: {"token_env": d, "control_token_env": c, "adapter_root": str(roots[n])} for n, (d, c) in RUNS.items()}


def run(scenario, urls, run_tokens, roots: dict[str, str]):
    """A proxy serving runs math and code (their adapters below ``roots``); ``scenario(clients,
    proxy)`` with one client per run and the pool's own ("")."""

    async def main():
        runs = shared(roots)
        api = getattr(urls, "api", "sglang")
        config = ProxyConfig(
            engine_urls=urls, engine_api=api, port=0, metrics_port=0, health_check_interval_s=0.2, runs=runs
        )
        server, proxy = await start_proxy(config)
        address = f"127.0.0.1:{server.bound_port}"
        clients = {"": ProxyClient(address)} | {n: ProxyClient(address, auth=a) for n, a in run_tokens.items()}
        try:
            return await scenario(clients, proxy)
        finally:
            await asyncio.gather(*(c.close() for c in clients.values()))
            await server.stop(0)
            await proxy.close()

    return asyncio.run(main())


GREEDY = {"temperature": 0.0, "ignore_eos": True}


async def publish(client: ProxyClient, path, version: int) -> pb.UpdateWeightsResponse:
    """What a shared run's controller and trainer do: suspend its requests, load, resume."""
    await client.suspend(pb.SUSPEND_MODE_CONTINUE)
    try:
        return await client.update_weights(str(path), version, adapter=True)
    finally:
        await client.resume()


def test_each_run_is_served_its_own_adapter_at_its_own_version(either_pool, tiny_model, adapters, run_tokens, both):
    base = [_greedy(tiny_model, None, p) for p in PROMPTS]
    want = {k: [_greedy(tiny_model, adapters[k][1], p) for p in PROMPTS] for k in ("a", "b")}

    async def answers(client):
        outs = await asyncio.gather(*(client.generate(p, N, **GREEDY) for p in PROMPTS))
        return [list(o.output_ids) for o in outs], {v for o in outs for v in o.token_versions}

    async def scenario(clients, proxy):
        assert await answers(clients["math"]) == (base, {0})  # a new LoRA policy is its base
        assert (await publish(clients["math"], adapters["a"][0], 1)).success
        assert (await publish(clients["code"], adapters["b"][0], 7)).success
        # both runs and the pool's own at once, over both engines: each gets its own policy
        got = await asyncio.gather(*(answers(clients[r]) for r in ("math", "code", "")))
        assert got == [(want["a"], {1}), (want["b"], {7}), (base, {0})]
        stats = {r: await clients[r].stats() for r in ("math", "code", "")}
        assert [stats[r].weight_version for r in ("math", "code", "")] == [1, 7, 0]
        assert {e.weight_version for e in stats["code"].engines} == {7}  # each engine holds code's v7

        # A new version replaces the old: the old adapter is unloaded from every engine.
        assert (await publish(clients["math"], adapters["b"][0], 2)).success
        assert await answers(clients["math"]) == (want["b"], {2})
        assert await loaded(either_pool) == [serving(proxy)] * 2  # the old one unloaded everywhere
        # Version 0 is the base again (a restore to the start).
        assert (await publish(clients["code"], tiny_model, 0)).success
        assert await answers(clients["code"]) == (base, {0})

        # An adapter an engine cannot load: the update fails naming it, and the run keeps its policy.
        res = await publish(clients["math"], both["math"], 3)  # a folder, and no adapter in it
        assert not res.success and all(e.cause == "rejected" and e.message for e in res.engines)
        assert await answers(clients["math"]) == (want["b"], {2})
        assert await loaded(either_pool) == [serving(proxy)] * 2  # the failed one unloaded too
        assert (await publish(clients["math"], tiny_model, 0)).success
        assert await loaded(either_pool) == [[], []]

    run(scenario, either_pool, run_tokens, both)


def test_a_runs_suspend_stops_its_requests_only_and_they_continue_under_its_new_adapter(
    pool, tiny_model, adapters, run_tokens, both
):
    async def scenario(clients, proxy):
        assert (await publish(clients["math"], adapters["a"][0], 1)).success
        long = asyncio.ensure_future(clients["math"].generate([1, 2, 3], 600, request_id="long", **GREEDY))
        await in_flight(proxy, "math", "long")
        assert (await clients["math"].suspend(pb.SUSPEND_MODE_CONTINUE)).num_in_flight == 1
        assert (await clients["math"].stats()).suspended and not (await clients["code"].stats()).suspended
        # code's requests (and the pool's own) run while math's wait: no engine was paused
        other = await asyncio.gather(
            clients["code"].generate([1, 5], N, **GREEDY), clients[""].generate([1], N, **GREEDY)
        )
        assert [len(o.output_ids) for o in other] == [N, N] and not long.done()
        ok = await clients["math"].update_weights(str(adapters["b"][0]), 2, adapter=True)
        await clients["math"].resume()
        out = await long
        assert ok.success and len(out.output_ids) == 600 and out.num_segments >= 2  # cut, then continued
        versions = list(out.token_versions)  # any tokens made before the cut under v1, the rest under v2
        assert versions == sorted(versions) and versions[-1] == 2 and set(versions) <= {1, 2}

        # A run's abort reaches its own requests only, even one of the same id.
        mine = asyncio.ensure_future(clients["math"].generate([1, 4], 600, request_id="x", **GREEDY))
        theirs = asyncio.ensure_future(clients["code"].generate([1, 6], 200, request_id="x", **GREEDY))
        await in_flight(proxy, "math", "x")
        await in_flight(proxy, "code", "x")
        assert (await clients["code"].abort(request_id="nobody's")).num_aborted == 0
        assert (await clients["math"].abort(abort_all=True)).num_aborted == 1
        assert (await mine).finish_reason == common_pb2.FINISH_REASON_ABORT
        assert len((await theirs).output_ids) == 200
        # A run whose stream goes away aborts its request, not another's of the same id.
        theirs = asyncio.ensure_future(clients["code"].generate([1, 6], 300, request_id="y", **GREEDY))
        sp = SamplingParams(max_new_tokens=600, **GREEDY)
        req = generate_request([1, 4], sp, "y", "", 0.0, 0, False, ())
        stream = clients["math"].stub.GenerateStream(req, timeout=60)
        await stream.read()
        await in_flight(proxy, "code", "y")
        aborted = proxy.counters["finished_abort"]
        stream.cancel()
        assert len((await theirs).output_ids) == 300
        for _ in range(200):  # the proxy aborts math's at the engine
            if ("math", "y") not in proxy.in_flight:
                break
            await asyncio.sleep(0.05)
        assert ("math", "y") not in proxy.in_flight and proxy.counters["finished_abort"] == aborted + 1

    run(scenario, pool, run_tokens, both)


def test_a_runs_tokens_reach_neither_the_base_weights_nor_another_run(pool, tiny_model, adapters, run_tokens):
    """math publishes below adapters/a, code below adapters/b."""
    a, b = adapters["a"][0], adapters["b"][0]
    link = a / "code"  # math's folder holds a link to code's: followed, and refused
    if not link.is_symlink():
        link.symlink_to(b)

    async def code(clients, status, call):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == status, e.value.details()
        return e.value.details()

    async def scenario(clients, proxy):
        math = clients["math"]
        denied = grpc.StatusCode.PERMISSION_DENIED
        # the base weights are the pool's: a full-weight update, buckets, memory, groups
        assert "run" in await code(clients, denied, math.update_weights(tiny_model, 1))
        refused = [
            math.update_weights_bucket(1, 0, b"x", True, str(a)),
            math.init_weights_group("127.0.0.1", 29500, "g", "gloo"),
            math.update_weights_distributed(1, 0, [("w", "float32", [1])], True, str(a), ""),
            math.release_memory(60.0, ["kv_cache"]),
            math.resume_memory(["kv_cache"]),
        ]
        for call in refused:
            assert "shares this proxy's engines" in await code(clients, denied, call)
        # another run's adapter: not below its own folder, even through a link
        for path in (b, link, "adapters/a"):
            details = await code(
                clients, grpc.StatusCode.INVALID_ARGUMENT, math.update_weights(str(path), 1, adapter=True)
            )
            assert "model_path" in details and "adapter_root" in details
        assert (await math.update_weights(str(a), 1, adapter=True)).success
        # in-place suspends pause whole engines: refused naming the mode
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        assert "mode" in await code(clients, invalid, math.suspend(pb.SUSPEND_MODE_IN_PLACE))
        # a run's data token is not its control token
        data = run_tokens["math"].token
        data_only = ProxyClient(math.address, auth=AuthConfig(token=data, control_token=data))
        try:
            await code(clients, denied, data_only.suspend(pb.SUSPEND_MODE_CONTINUE))
        finally:
            await data_only.close()
        stranger = ProxyClient(math.address, auth=AuthConfig(token=SecretStr("x"), control_token=SecretStr("y")))
        try:
            await code(clients, grpc.StatusCode.UNAUTHENTICATED, stranger.generate([1], N, **GREEDY))
        finally:
            await stranger.close()
        # code's update and suspend never touch math's lane; its stats show none of math's
        assert (await publish(clients["code"], b, 4)).success
        assert (await math.stats()).weight_version == 1 and not proxy.lanes["math"].suspended
        await math.generate([1], N, **GREEDY)
        stats = await clients["code"].stats()
        assert stats.requests_total == 0 and all(e.url == "" for e in stats.engines)

    run(scenario, pool, run_tokens, {"math": a, "code": b})


def test_a_shared_runs_controller_rolls_back_and_restores_its_adapter(
    pool, tiny_model, adapters, run_tokens, tmp_path, both
):
    """The controller of a run that publishes adapters (train_loop.publisher disk with adapter) sends
    them as adapters when it rolls an update back and when it restores its version at a restart."""
    from services.controller.config import ControllerConfig
    from services.controller.server import start_controller

    async def scenario(clients, proxy):
        math = proxy.lanes["math"]

        async def controller():
            config = ControllerConfig(
                initial_model_path=tiny_model, port=0, metrics_port=0, state_path=str(tmp_path / "ctl.json")
            )
            config._adapter_updates = True
            return await start_controller(config, clients["math"].address, auth=run_tokens["math"])

        server, ctl, ctl_clients = await controller()
        try:
            update = await ctl.begin_update(1)
            assert math.suspended and not proxy.lanes["code"].suspended
            assert (await clients["math"].update_weights(str(adapters["a"][0]), 1, adapter=True)).success
            await ctl.commit_update(update, 1, str(adapters["a"][0]))
            assert not math.suspended and (math.version, math.path) == (1, str(adapters["a"][0]))
            update = await ctl.begin_update(2)
            assert (await clients["math"].update_weights(str(adapters["b"][0]), 2, adapter=True)).success
            await ctl.abort_update(update, "the trainer failed")  # back to v1: adapter a
            assert (math.version, math.path, math.suspended) == (1, str(adapters["a"][0]), False)
        finally:
            await server.stop(0)
            await ctl.close()
            await ctl_clients.close()
        # A new proxy lane (a restarted proxy's) and a restarted controller: v1's adapter again.
        await clients["math"].update_weights(tiny_model, 0, adapter=True)
        assert math.adapter is None
        server, ctl, ctl_clients = await controller()
        try:
            assert ctl.version == 1 and (math.version, math.path) == (1, str(adapters["a"][0]))
        finally:
            await server.stop(0)
            await ctl.close()
            await ctl_clients.close()
        await clients["math"].update_weights(tiny_model, 0, adapter=True)

    run(scenario, pool, run_tokens, both)


def test_adapters_no_lane_serves_are_unloaded_after_a_proxy_restart_and_a_full_update(
    pool, tiny_model, adapters, run_tokens, both
):
    """A proxy that stops with adapters loaded leaves them on the engines: its successor unloads
    them. The proxy's own run may serve an adapter too, until a full-weight update replaces it."""

    async def first(clients, proxy):
        assert (await publish(clients["math"], adapters["a"][0], 1)).success
        assert (await publish(clients[""], adapters["b"][0], 1)).success  # the pool's own run, an adapter
        assert await loaded(pool) == [serving(proxy)] * 2 and len(serving(proxy)) == 2

    async def second(clients, proxy):
        assert await loaded(pool) == [[], []]  # a new proxy serves no lane's adapter yet: none stay loaded
        assert (await publish(clients[""], adapters["b"][0], 1)).success
        got = await clients[""].generate(PROMPTS[0], N, **GREEDY)
        assert list(got.output_ids) == _greedy(tiny_model, adapters["b"][1], PROMPTS[0])
        assert (await clients[""].update_weights(tiny_model, 2)).success  # whole weights: the adapter goes
        got = await clients[""].generate(PROMPTS[0], N, **GREEDY)
        assert list(got.output_ids) == _greedy(tiny_model, None, PROMPTS[0]) and set(got.token_versions) == {2}
        assert await loaded(pool) == [[], []]

    run(first, pool, run_tokens, both)
    run(second, pool, run_tokens, both)


def test_run_tokens_are_required_distinct_and_never_with_auth_disabled(monkeypatch, run_tokens):
    runs = ProxyConfig(runs=shared({"math": "/m", "code": "/c"})).runs  # (folders: the proxy checks them)
    mesh = AuthConfig(token=SecretStr("mesh-data"), control_token=SecretStr("mesh-control"))
    assert set(RunTokens(runs, mesh).bearers[next(iter(RunTokens(runs, mesh).bearers))]) == set(RUNS)
    monkeypatch.delenv("RM_TEST_CODE_CONTROL")
    with pytest.raises(AuthError, match=r"proxy.runs.code.control_token_env: \$RM_TEST_CODE_CONTROL is not set"):
        RunTokens(runs, mesh)
    monkeypatch.setenv("RM_TEST_CODE_CONTROL", "mesh-data")  # one of the mesh's own
    with pytest.raises(AuthError, match="differ"):
        RunTokens(runs, mesh)
    with pytest.raises(AuthError, match="auth.disabled"):
        RunTokens(runs, AuthConfig(disabled=True))
    from rollout.proxy import LLMProxy

    with pytest.raises(ValueError, match="proxy.runs.math.adapter_root: /m is not a folder"):
        LLMProxy(ProxyConfig(runs=shared({"math": "/m", "code": "/"})))  # made by the pool's operator first
    with pytest.raises(ValueError, match="lower-case"):
        ProxyConfig(runs={"Math!": {"token_env": "A", "control_token_env": "B", "adapter_root": "/m"}})


@pytest.mark.timeout(600)
def test_two_lora_runs_train_side_by_side_on_one_engine_pool(tiny_model, tmp_path, monkeypatch, run_tokens):
    """`rollmesh run` twice with run.num_engines 0 against one engine behind one LLMProxy that knows
    both runs: each trains its own LoRA policy, publishes only its adapter, and ends with the proxy
    serving it its last version; the engine's base weights never change."""
    import json
    import os
    import subprocess

    from services.auth import CONTROL_TOKEN_ENV, TOKEN_ENV
    from services.processes import start_service_process
    from tests.test_run_e2e import quickstart_cmd

    engine, url = start_engine_process(tiny_model, extra=[f"load_roots=[{tmp_path}]"])
    for name in RUNS:  # the pool's operator makes each run's folder
        (tmp_path / name / "weights").mkdir(parents=True)
    runs = ", ".join(
        f"{n}: {{token_env: {d}, control_token_env: {c}, adapter_root: {tmp_path / n / 'weights'}}}"
        for n, (d, c) in RUNS.items()
    )
    proxy, address = start_service_process(
        "llm-proxy", "proxy", [f"engine_urls=[{url}]", "metrics_port=0", f"runs={{{runs}}}"]
    )
    steps = 2
    procs = {}
    try:
        for name, auth in run_tokens.items():
            cmd = quickstart_cmd(
                tiny_model,
                tmp_path / name,
                "run.num_engines=0",
                f"mesh.proxy={address}",
                "trainer.lora={rank: 4, alpha: 8}",
                "train_loop.publisher={type: disk, adapter: true}",
                f"train_loop.steps={steps}",
                "controller.groups_per_step=2",
                "buffer.filter_zero_variance=false",
                "run.heldout_path=null",
            )
            env = dict(os.environ)  # the run's own tokens: how the proxy knows it
            env[TOKEN_ENV], env[CONTROL_TOKEN_ENV] = (
                auth.token.get_secret_value(),
                auth.control_token.get_secret_value(),
            )
            procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        outs = {name: p.communicate(timeout=500)[0] for name, p in procs.items()}
        for name, p in procs.items():
            assert p.returncode == 0, outs[name][-3000:]
            assert f"final: steps={steps} " in outs[name]
            records = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in records] == list(range(1, steps + 1))
            adapter = tmp_path / name / "weights" / f"v{steps}"
            assert (adapter / "adapter_config.json").is_file()  # PEFT's directory, not a model
            model_bytes = sum(f.stat().st_size for f in Path(tiny_model).glob("*.safetensors"))
            assert 0 < records[-1]["weight_update_bytes"] < model_bytes / 10

        async def served():
            clients = [ProxyClient(address, auth=a) for a in run_tokens.values()] + [ProxyClient(address)]
            try:
                return [(await c.stats()).weight_version for c in clients]
            finally:
                await asyncio.gather(*(c.close() for c in clients))

        assert asyncio.run(served()) == [steps, steps, 0]  # each run's last version; the base untouched
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        stop_process(proxy)
        stop_process(engine)
