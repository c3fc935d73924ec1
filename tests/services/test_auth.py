"""Every endpoint a network can reach refuses a call without the run's token; TLS works end to end."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout.proxy import ProxyConfig
from sample_buffer.config import BufferConfig
from services.auth import (
    CONTROL_METHODS,
    REFUSED,
    TOKEN_ENV,
    AuthConfig,
    AuthError,
    Role,
    TlsConfig,
    http_headers,
    role_of,
)
from services.llm_proxy.client import ProxyClient
from services.llm_proxy.server import engine_client, start_proxy
from services.pb.rollmesh.v1 import controller_pb2, env_manager_pb2, llm_proxy_pb2, sample_buffer_pb2
from services.processes import free_port, start_engine_process, start_service_process, stop_process, wait_grpc_healthy
from services.sample_buffer.client import BufferClient
from services.sample_buffer.server import start_buffer_service
from tests.sample_buffer.helpers import make_group
from tests.services.mesh import local_mesh

WRONG = [("authorization", "Bearer not-the-token")]


async def _refusals(address: str, service) -> dict[str, set]:
    """Call every RPC of ``service`` with no token and with a wrong one: the status codes seen."""
    seen: dict[str, set] = {}
    async with grpc.aio.insecure_channel(address) as ch:
        for method in service.methods:
            path = f"/{service.full_name}/{method.name}"
            kind = ch.unary_stream if method.server_streaming else ch.unary_unary
            for metadata in (None, WRONG):
                call = kind(path)(b"", timeout=10, metadata=metadata)
                try:
                    if method.server_streaming:
                        async for _ in call:
                            pass
                    else:
                        await call
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    code = e.code()
                    assert "authorization" in (e.details() or ""), e.details()
                seen.setdefault(method.name, set()).add(code)
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no secret
    return seen


def test_every_rpc_of_every_service_refuses_a_missing_or_wrong_token(engine_url, tiny_model, tmp_path):
    async def main():
        async with local_mesh(engine_url, tiny_model) as mesh:
            addresses = {
                llm_proxy_pb2.DESCRIPTOR.services_by_name["LLMProxy"]: mesh.proxy_client.address,
                sample_buffer_pb2.DESCRIPTOR.services_by_name["SampleBuffer"]: mesh.buffer_client.address,
                controller_pb2.DESCRIPTOR.services_by_name["AsyncController"]: mesh.controller_client.address,
            }
            wiring = [
                f"mesh.proxy={mesh.proxy_client.address}",
                f"mesh.buffer={mesh.buffer_client.address}",
                f"mesh.controller={mesh.controller_client.address}",
                f"model_path={tiny_model}",
                "env_manager.dataset_path=examples/find_digit_train.jsonl",
                "autostart=false",
                f"metrics_port={free_port()}",
            ]
            env_proc, env_address = await asyncio.to_thread(start_service_process, "env-manager", "env_manager", wiring)
            try:
                addresses[env_manager_pb2.DESCRIPTOR.services_by_name["EnvManager"]] = env_address
                before = REFUSED["missing"] + REFUSED["wrong"]
                for service, address in addresses.items():
                    seen = await _refusals(address, service)
                    assert len(seen) == len(service.methods) > 0
                    assert all(codes == {grpc.StatusCode.UNAUTHENTICATED} for codes in seen.values()), seen
                in_process = sum(len(s.methods) for s in addresses if s.name != "EnvManager")
                assert REFUSED["missing"] + REFUSED["wrong"] - before == 2 * in_process  # counted, each one
                metrics = httpx.get(f"http://127.0.0.1:{wiring[-1].split('=')[1]}/metrics", timeout=10).text
                n_env = len(env_manager_pb2.DESCRIPTOR.services_by_name["EnvManager"].methods)
                assert f'rollmesh_auth_refused_requests_total{{reason="missing"}} {float(n_env)}' in metrics
                # and the token lets the same calls through
                assert (await mesh.buffer_client.stats()).depth == 0
                assert (await mesh.proxy_client.stats()).engines[0].healthy
            finally:
                stop_process(env_proc)

    asyncio.run(main())


def test_the_control_methods_are_methods_of_the_protos():
    """A renamed RPC must not fall out of the control list and quietly take the data token."""
    from services.pb.rollmesh.v1 import reward_pb2

    services = {
        s.full_name: s
        for module in (llm_proxy_pb2, sample_buffer_pb2, controller_pb2, env_manager_pb2, reward_pb2)
        for s in module.DESCRIPTOR.services_by_name.values()
    }
    for service, methods in CONTROL_METHODS.items():
        assert methods <= {m.name for m in services[service].methods_by_name.values()}, service
    assert role_of("/rollmesh.v1.LLMProxy/UpdateWeightsBucket") is Role.CONTROL
    assert role_of("/rollmesh.v1.LLMProxy/Generate") is Role.DATA
    assert role_of("/rollmesh.v1.SampleBuffer/Put") is Role.DATA
    assert role_of("/rollmesh.v1.AsyncController/CommitUpdate") is Role.CONTROL
    assert role_of("/rollmesh.v1.AsyncController/Admit") is Role.DATA


def test_a_call_takes_its_methods_role_token_and_no_other(engine_url, tiny_model):
    """The data token (what EnvManagers, gateways and reward services hold) cannot suspend the
    engines, update weights or commit a version; the control token is not a data token either."""
    data, control = AuthConfig().bearer(Role.DATA), AuthConfig().bearer(Role.CONTROL)

    async def call(address: str, path: str, bearer: str):
        async with grpc.aio.insecure_channel(address) as ch:
            try:
                await ch.unary_unary(path)(b"", timeout=10, metadata=[("authorization", bearer)])
                return grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()

    async def main():
        async with local_mesh(engine_url, tiny_model) as mesh:
            proxy, ctl = mesh.proxy_client.address, mesh.controller_client.address
            before = REFUSED["role"]
            for address, path in (
                (proxy, "/rollmesh.v1.LLMProxy/Suspend"),
                (proxy, "/rollmesh.v1.LLMProxy/UpdateWeightsBucket"),
                (proxy, "/rollmesh.v1.LLMProxy/InitWeightsGroup"),
                (ctl, "/rollmesh.v1.AsyncController/CommitUpdate"),
            ):
                code, details = await call(address, path, data)
                assert code == grpc.StatusCode.PERMISSION_DENIED, (path, code)
                assert "takes the control token (ROLLMESH_CONTROL_TOKEN)" in details, details
            code, details = await call(proxy, "/rollmesh.v1.LLMProxy/Stats", control)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "takes the data token" in details
            assert REFUSED["role"] - before == 5  # counted apart from missing and wrong tokens
            # The right token passes: Stats with data, Resume with control (an empty message is valid).
            assert (await call(proxy, "/rollmesh.v1.LLMProxy/Stats", data))[0] == grpc.StatusCode.OK
            assert (await call(proxy, "/rollmesh.v1.LLMProxy/Resume", control))[0] == grpc.StatusCode.OK

            # A process that holds the data token only fails a control call before sending anything.
            data_only = AuthConfig(control_token=None)
            client = ProxyClient(proxy, auth=data_only)
            try:
                assert (await client.stats()).engines[0].healthy
                with pytest.raises(AuthError, match="ROLLMESH_CONTROL_TOKEN"):
                    await client.suspend()
            finally:
                await client.close()

    asyncio.run(main())


def test_every_engine_route_refuses_a_missing_or_wrong_token(engine_url):
    token = http_headers(AuthConfig())
    paths = httpx.get(engine_url + "/openapi.json", headers=token, timeout=10).json()["paths"]
    assert httpx.get(engine_url + "/openapi.json", timeout=10).status_code == 401
    routes = [(m.upper(), p) for p, ops in paths.items() for m in ops if p not in ("/health", "/metrics")]
    assert len(routes) >= 10
    data = AuthConfig().bearer(Role.DATA)  # the engines' API is control: the data token is a wrong one there
    for method, path in routes:
        for headers in ({}, {"Authorization": data}, {"Authorization": token["Authorization"] + "x"}):
            r = httpx.request(method, engine_url + path, headers=headers, json={}, timeout=10)
            assert r.status_code == 401, (method, path, r.status_code)
            assert r.json()["field"] == "authorization" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(engine_url + "/health", timeout=10).status_code == 200
    metrics = httpx.get(engine_url + "/metrics", timeout=10).text  # scraped without a secret
    refused = 'rollmesh_auth_refused_requests_total{reason="missing"}'
    missing = next(line for line in metrics.splitlines() if line.startswith(refused))
    assert float(missing.split()[-1]) >= len(routes) + 1
    ok = httpx.post(
        engine_url + "/generate",
        headers=token,
        timeout=60,
        json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
    )
    assert ok.status_code == 200 and ok.json()["output_ids"]


def test_a_service_without_a_token_refuses_to_start_unless_auth_is_disabled(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    port, metrics_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "launch.cli",
        "serve",
        "sample-buffer",
        "--set",
        f"buffer.port={port}",
        "--set",
        "buffer.metrics_port=0",
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and TOKEN_ENV in res.stderr and "auth.disabled" in res.stderr, res.stderr
    log = tmp_path / "open.log"
    with open(log, "wb") as out:
        open_ = subprocess.Popen(
            [*cmd, "--set", "auth.disabled=true", "--set", f"buffer.metrics_port={metrics_port}"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:  # a closed network may say so: then no call needs a token, and the service says it loudly
        wait_grpc_healthy(f"127.0.0.1:{port}", 60, open_)
        assert "serving WITHOUT a token" in log.read_text()
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert "rollmesh_auth_disabled 1.0" in metrics

        async def stats():
            client = BufferClient(f"127.0.0.1:{port}", auth=AuthConfig(disabled=True))
            try:
                return await client.stats()
            finally:
                await client.close()

        assert asyncio.run(stats()).depth == 0
    finally:
        stop_process(open_)


def _health(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launch.cli", "health", *args, "--timeout-s", "3"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A CA made here and a certificate it signs for 127.0.0.1: what a test cluster would mount."""
    import trustme

    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    cert.private_key_pem.write_to_path(str(d / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    return TlsConfig(cert_path=str(d / "cert.pem"), key_path=str(d / "key.pem"), ca_path=str(d / "ca.pem"))


def test_tls_from_client_to_buffer_and_through_the_proxy_to_an_https_engine(tls, tiny_model):
    auth = AuthConfig(tls=tls)
    flags = [f"auth.tls.{k}={v}" for k, v in tls.model_dump().items()]
    engine, url = start_engine_process(tiny_model, extra=flags, auth=auth)
    try:
        assert url.startswith("https://")
        with pytest.raises(httpx.HTTPError):  # plaintext finds nobody
            httpx.get(url.replace("https://", "http://") + "/health", timeout=5)
        # `rollmesh health` (the containers' checks) speaks TLS with the run's CA, and only then is healthy
        ca = f"auth.tls.ca_path={tls.ca_path}"
        assert _health("--http", url, "--set", ca).returncode == 0
        assert _health("--http", url).returncode == 1

        async def main():
            direct = await engine_client(url, auth).generate([1, 2], {"max_new_tokens": 2})
            assert direct.output_ids
            proxy_server, proxy = await start_proxy(ProxyConfig(engine_urls=[url], port=0, metrics_port=0), auth)
            buf_server, buf, refresh = await start_buffer_service(BufferConfig(port=0, metrics_port=0), auth)
            clients = [
                ProxyClient(f"127.0.0.1:{proxy_server.bound_port}", auth=auth),
                BufferClient(f"127.0.0.1:{buf_server.bound_port}", auth=auth),
            ]
            plain = BufferClient(f"127.0.0.1:{buf_server.bound_port}", auth=AuthConfig(), timeout_s=3)
            try:
                grpc_address = f"127.0.0.1:{buf_server.bound_port}"
                assert (await asyncio.to_thread(_health, grpc_address, "--set", ca)).returncode == 0
                unhealthy = await asyncio.to_thread(_health, grpc_address)
                assert unhealthy.returncode == 1 and "unhealthy" in unhealthy.stderr
                out = await clients[0].generate([1, 2, 3], 3)
                assert len(out.output_ids) >= 1  # client -TLS-> proxy -HTTPS-> engine
                assert (await clients[1].put(make_group("g0"))).accepted
                assert (await clients[1].stats()).depth == 1
                with pytest.raises(Exception) as refused:  # a plaintext client cannot talk to a TLS port
                    await plain.stats()
                assert "UNAVAILABLE" in repr(refused.value) or "ssl" in repr(refused.value).lower()
            finally:
                for c in [*clients, plain]:
                    await c.close()
                refresh.cancel()
                for s in (proxy_server, buf_server):
                    await s.stop(0)
                await buf.close()
                await proxy.close()

        asyncio.run(main())
    finally:
        stop_process(engine)


def test_the_vllm_plugin_refuses_to_serve_on_an_empty_token(monkeypatch):
    """An empty ROLLMESH_CONTROL_TOKEN used to leave vLLM open; now only an explicit opt-out does."""
    from services.engine.vllm_server import PLUGIN_DIR

    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    import rollmesh_vllm

    monkeypatch.setenv("ROLLMESH_CONTROL_TOKEN", "")
    monkeypatch.delenv("ROLLMESH_AUTH_DISABLED", raising=False)
    with pytest.raises(RuntimeError, match="ROLLMESH_CONTROL_TOKEN is empty"):
        rollmesh_vllm.BearerCheck(app=None)
    monkeypatch.setenv("ROLLMESH_AUTH_DISABLED", "1")
    assert rollmesh_vllm.BearerCheck(app=None).expected is None
    monkeypatch.setenv("ROLLMESH_CONTROL_TOKEN", "t")
    assert rollmesh_vllm.BearerCheck(app=None).expected == b"Bearer t"
