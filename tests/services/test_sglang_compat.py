"""The SGLang client and the LLMProxy against a server that answers as stock SGLang does.

SGLang itself needs a GPU; ``sglang_standin`` generates with the embedded engine and shapes every
answer as SGLang's ``http_server.py`` does (empty bodies, no version in the update's answer, the
model info at ``/get_model_info`` only, string versions).
"""

from __future__ import annotations

import asyncio

import pytest

from rollout.engines.sglang.client import EngineUnavailable, SGLangClient
from rollout.proxy import ProxyConfig
from services.llm_proxy.client import ProxyClient
from services.llm_proxy.server import start_proxy
from services.pb.rollmesh.v1 import common_pb2
from tests.services.sglang_standin import StandIn


@pytest.fixture(scope="module")
def sglang(tiny_model):
    with StandIn(tiny_model) as s:
        yield s


def test_the_client_reads_sglang_answers(sglang, tiny_model_b):
    async def go():
        client = SGLangClient(sglang.url, timeout_s=30)
        try:
            healthy = await client.health()  # 200, empty body
            info = await client.model_info()  # /model_info is 404 there: /get_model_info
            await client.model_info()
            out = await client.generate([1, 5, 6], {"max_new_tokens": 4, "ignore_eos": True})
            aborted = await client.abort("nobody")  # 200, empty body
            updated = await client.update_weights_from_disk(tiny_model_b, 3)
            after = await client.generate([1, 5, 6], {"max_new_tokens": 2, "ignore_eos": True})
            with pytest.raises(EngineUnavailable, match="not a JSON object: 'Cache flushed"):
                await client._get("/flush_cache")
            return healthy, info, out, aborted, updated, after
        finally:
            await client.close()

    healthy, info, out, aborted, updated, after = asyncio.run(go())
    assert healthy and info["weight_version"] == "default" and aborted == {}
    assert sglang.calls.count("/model_info") == 1 and sglang.calls.count("/get_model_info") >= 2
    assert len(out.output_ids) == 4 and len(out.behavior_logprobs) == 4 and out.token_versions == [0] * 4
    # SGLang names its initial weights "default": version 0, like every engine at start
    # SGLang's answer has no version: the client read it back from the model info
    assert updated["success"] and updated["weight_version"] == 3 and "num_paused_requests" in updated
    assert after.weight_version == 3 and after.token_versions == [3, 3]


def test_the_proxy_runs_on_sglang_answers_update_deadline_abort(sglang, tiny_model):
    async def go():
        config = ProxyConfig(engine_urls=[sglang.url], port=0, metrics_port=0, health_check_interval_s=0.2)
        server, proxy = await start_proxy(config)  # its start probes /health: an empty body
        client = ProxyClient(f"127.0.0.1:{server.bound_port}")
        try:
            update = await client.update_weights(tiny_model, 7)
            out = await client.generate([1, 6], 3, ignore_eos=True)
            timed = await client.generate([1, 7], 1000, timeout_s=0.3, ignore_eos=True)  # aborted at the deadline
            await asyncio.sleep(0.5)
            return update, out, timed, await client.stats(), [s.healthy for s in proxy.router.engines]
        finally:
            await client.close()
            await server.stop(0)
            await proxy.close()

    update, out, timed, stats, healthy = asyncio.run(go())
    assert update.success and [e.weight_version for e in update.engines] == [7], update
    assert stats.weight_version == 7 and list(out.token_versions) == [7, 7, 7]
    assert timed.finish_reason == common_pb2.FINISH_REASON_TIMEOUT and 0 < len(timed.output_ids) < 1000
    assert healthy == [True] and sglang.engine.load()["num_running"] == 0  # the abort reached the engine
