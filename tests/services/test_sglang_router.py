"""SGLang's own router (``sglang-router``, its PyPI wheel) in front of the embedded engine: it
health-checks the engine with the control token, forwards ``/generate`` (adding a ``model`` field
SGLang ignores, so the engine does too) with ``input_ids`` and log-probs, and streams."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from services.auth import AuthConfig, Role
from services.processes import free_port, stop_process, wait_http_healthy

BODY = {
    "input_ids": [1, 4, 5],
    "return_logprob": True,
    "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
}


@pytest.fixture(scope="module")
def router(engine_url, tmp_path_factory):
    port = free_port()
    token = AuthConfig().bearer(Role.CONTROL).removeprefix("Bearer ")
    log = tmp_path_factory.mktemp("router") / "router.log"
    # The router takes its key on the command line (its own interface): a test token only.
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--worker-urls", engine_url, "--api-key", token, "--log-level", "warn"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_healthy(url + "/health", 60, proc)
        yield url
    finally:
        stop_process(proc)


def ignored_model_fields(engine_url: str) -> float:
    text = httpx.get(engine_url + "/metrics", timeout=10).text
    line = 'rollmesh_engine_ignored_fields_total{field="model"}'
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


def test_the_sglang_router_fronts_the_embedded_engine(router, engine_url):
    headers = {"Authorization": AuthConfig().bearer(Role.CONTROL)}
    before = ignored_model_fields(engine_url)
    direct = httpx.post(engine_url + "/generate", json=BODY, headers=headers, timeout=60)
    routed = httpx.post(router + "/generate", json=BODY, headers=headers, timeout=60)
    assert direct.status_code == routed.status_code == 200, routed.text
    assert routed.json()["output_ids"] == direct.json()["output_ids"]  # greedy: the same tokens
    logprobs = [lp for lp, *_ in routed.json()["meta_info"]["output_token_logprobs"]]
    assert len(logprobs) == 6 and all(lp <= 0 for lp in logprobs)
    assert ignored_model_fields(engine_url) >= before + 1  # what the router added, ignored as SGLang does
    assert httpx.post(router + "/generate", json=BODY, timeout=60).status_code == 401  # the router's key

    chunks = []
    stream = {**BODY, "stream": True}
    with httpx.stream("POST", router + "/generate", json=stream, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(x.removeprefix("data: ")) for x in r.iter_lines() if x.startswith("data: {")]
    assert [len(c["output_ids"]) for c in chunks][-1] == 6 and chunks[-1]["output_ids"] == direct.json()["output_ids"]
