"""What ``test_fuzz.py`` left out, fuzzed the same way (hypothesis; every answer a clean one, the
server serving afterwards): the agent gateway's OpenAI routes, an environment provider's OpenEnv
HTTP routes and WebSocket, and the reward service's gRPC methods.

A clean answer over HTTP: 200, or a 4xx whose body names the field at fault (the gateway in OpenAI's
``{"error": {"param"}}``, the provider as every rollmesh route: ``{"field", "message"}``); never a
5xx. Over the WebSocket: an ``error`` message naming the field, and the connection stays usable.
"""

from __future__ import annotations

import json

import httpx
import pytest
import websockets
from hypothesis import given
from hypothesis import strategies as st

from services.auth import PROVIDER_TOKEN_ENV, AuthConfig, provider_auth
from services.grpc_util import channel
from services.pb.rollmesh.v1 import reward_pb2 as rpb
from services.processes import stop_process
from tests.services.test_fuzz import JSON_VALUES, Loop, _is_json_object, _paths, fuzz, fuzz_unary_methods
from tests.services.test_gateway import KEYS, gateway


@pytest.fixture(scope="module")
def aio():
    loop = Loop()
    yield loop
    loop.close()


def damaged(body: dict, kind: str, draw) -> tuple[bytes, str]:
    """``body`` damaged the ``kind`` way, as bytes, and the field an error must name ("" = any)."""
    text = json.dumps(body)
    # (Never empty: where a body is optional, none is a valid request.)
    if kind == "truncated":  # a prefix of a JSON object is never JSON
        return text[: draw(st.integers(1, len(text) - 1))].encode(), "body"
    if kind == "not_json":
        data = st.one_of(st.binary(min_size=1, max_size=40), JSON_VALUES.map(lambda v: json.dumps(v).encode()))
        return draw(data.filter(lambda b: not _is_json_object(b))), "body"
    path = draw(st.sampled_from(_paths(body)))
    *parents, leaf = path.split(".")
    target = json.loads(text)
    inner = target
    for p in parents:
        inner = inner[p]
    inner[leaf] = draw(JSON_VALUES)
    return json.dumps(target).encode(), path.split(".")[0]


MUST_FAIL = {"truncated", "not_json"}


# ---------------------------------------------------------------------------------------------- the agent gateway
def chat(max_tokens: int = 2) -> dict:
    return {
        "model": "rollmesh-policy",
        "messages": [{"role": "user", "content": "Add 3 and 4."}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }


TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
GATEWAY_BODIES = {
    "/v1/chat/completions": chat(),
    "/v1/completions": {"model": "rollmesh-policy", "prompt": "3 + 4 =", "max_tokens": 2, "temperature": 0.0},
    "/v1/sessions": {"group": "g", "group_size": 2},
    # every field an agent framework sends, inside a session (its tree, its caps)
    "/sessions/{sid}/v1/chat/completions": {
        **chat(),
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Add 3 and 4."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "7"},
        ],
        "tools": [TOOL],
        "tool_choice": "auto",
        "logprobs": True,
        "top_logprobs": 2,
        "n": 2,
        "stop": ["\n\n", "END"],
        "seed": 3,
        "top_p": 0.9,
        "temperature": 0.7,
    },
    "/sessions/{sid}/v1/completions": {
        "model": "rollmesh-policy",
        "prompt": [1, 2, 3],
        "max_tokens": 2,
        "logprobs": 2,
        "n": 2,
        "stop": "END",
    },
    "/v1/sessions/{sid}/reward": {"reward": 0.5},
}


@pytest.fixture(scope="module")
def gateway_url(aio, engine_url, tiny_model):
    # Every session takes a rollout slot: a staleness bound no fuzzing run reaches.
    context = gateway(engine_url, tiny_model, controller={"async_ratio": 10_000, "groups_per_step": 4})
    url, _, _ = aio.run(context.__aenter__())
    yield url
    aio.run(context.__aexit__(None, None, None))


def test_the_gateway_answers_hostile_json_with_a_4xx_naming_the_param(aio, gateway_url):
    headers = {"authorization": f"Bearer {KEYS['alice']}", "content-type": "application/json"}

    async def post(path: str, body: bytes) -> httpx.Response:
        async with httpx.AsyncClient(base_url=gateway_url, headers=headers, timeout=60) as c:
            return await c.post(path, content=body)

    made = aio.run(post("/v1/sessions", json.dumps({"group": "fuzz", "group_size": 1}).encode()))
    sid = made.json()["id"]

    @fuzz(150)
    @given(data=st.data())
    def run(data):
        route = data.draw(st.sampled_from(sorted(GATEWAY_BODIES)))
        kind = data.draw(st.sampled_from(["truncated", "not_json", "value"]))
        body, field = damaged(GATEWAY_BODIES[route], kind, data.draw)
        route = route.replace("{sid}", sid)
        r = aio.run(post(route, body))
        what = f"{route} {kind} {body[:200]!r}: HTTP {r.status_code} {r.text[:300]}"
        assert r.status_code == 200 or 400 <= r.status_code < 500, what
        optional = route == "/v1/sessions" and body == b"null"  # its body is optional: null is none
        assert r.status_code != 200 or kind not in MUST_FAIL or optional, what
        if r.status_code != 200:
            err = r.json()["error"]
            assert err["message"] and err["param"], what
            assert kind == "value" or err["param"] == field, what
            assert err["message"].startswith(err["param"]), what

    run()
    ok = aio.run(post("/v1/chat/completions", json.dumps(chat()).encode()))  # and it goes on serving
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant", ok.text


# ---------------------------------------------------------------------------------------------- an env provider
@pytest.fixture(scope="module")
def provider():
    from services.processes import start_provider_process

    proc, address, url = start_provider_process("tests.services.provider_envs:ScriptEnv", ["max_sessions=100000"])
    yield address, url
    stop_process(proc)


PROVIDER_BODIES = {
    "/reset": {"seed": 1, "episode_id": "fuzz-1"},
    "/step": {"episode_id": "fuzz-1", "action": {"content": "a"}, "request_id": "r", "timeout_s": 5.0},
    "/close": {"episode_id": "nobody"},
}


def provider_headers() -> dict:
    return {
        "authorization": provider_auth(AuthConfig(), PROVIDER_TOKEN_ENV).bearer(),
        "content-type": "application/json",
    }


def test_the_providers_openenv_routes_answer_hostile_json_with_a_4xx_naming_the_field(provider):
    _, url = provider
    with httpx.Client(base_url=url, headers=provider_headers(), timeout=30) as c:
        assert c.post("/reset", json=PROVIDER_BODIES["/reset"]).status_code == 200

        @fuzz(60)
        @given(data=st.data())
        def run(data):
            route = data.draw(st.sampled_from(sorted(PROVIDER_BODIES)))
            kind = data.draw(st.sampled_from(["truncated", "not_json", "value"]))
            body, field = damaged(PROVIDER_BODIES[route], kind, data.draw)
            r = c.post(route, content=body)
            what = f"{route} {kind} {body[:200]!r}: HTTP {r.status_code} {r.text[:300]}"
            assert r.status_code == 200 or 400 <= r.status_code < 500, what
            assert r.status_code != 200 or kind not in MUST_FAIL, what
            if r.status_code != 200:
                err = r.json()
                assert err["message"].startswith(err["field"] + ": "), what
                assert kind == "value" or err["field"] == field, what

        run()
        state = c.post("/reset", json={"seed": 4, "episode_id": "after"})
        assert state.status_code == 200 and state.json()["observation"]["content"] == "start 4"


def test_the_providers_websocket_answers_hostile_messages_with_an_error_naming_the_field(aio, provider):
    _, url = provider
    ws_url = url.replace("http://", "ws://") + "/ws"
    messages = st.one_of(
        st.text(max_size=60),  # not JSON, or JSON that is not an object
        JSON_VALUES.map(json.dumps),
        st.fixed_dictionaries(
            {"type": st.one_of(st.sampled_from(["reset", "step", "state", "close"]), st.text(max_size=8))},
            optional={"data": JSON_VALUES},
        ).map(json.dumps),
    )

    async def session(sent: list[str]) -> list[dict]:
        token = provider_headers()["authorization"]
        async with websockets.connect(ws_url, additional_headers={"authorization": token}, open_timeout=10) as ws:
            answers = []
            for m in sent:
                await ws.send(m)
                answers.append(json.loads(await ws.recv()))
            # the connection is still usable: an episode starts
            await ws.send(json.dumps({"type": "reset", "data": {"seed": 2}}))
            answers.append(json.loads(await ws.recv()))
            return answers

    @fuzz(40)
    @given(sent=st.lists(messages, min_size=1, max_size=4))
    def run(sent):
        answers = aio.run(session(sent))
        for m, a in zip(sent, answers, strict=False):
            assert a["type"] in ("observation", "state", "error"), (m, a)
            if a["type"] == "error":
                assert a["data"]["message"] and a["data"]["code"], (m, a)
        assert answers[-1]["type"] == "observation", answers[-1]
        assert answers[-1]["data"]["observation"]["content"] == "start 2"

    run()


# ---------------------------------------------------------------------------------------------- the reward service
def test_the_reward_service_answers_malformed_bytes_cleanly(aio):
    from tests.services.test_reward_service import call, start_reward_service

    proc, address, _ = start_reward_service("reward=digit_answer", "workers=1", "max_chars=200")
    try:
        ch = aio.run(_open(address))
        methods = {
            "Describe": rpb.RewardDescribeRequest(),
            "Score": rpb.ScoreRequest(response="7", answer="7", timeout_s=5.0, request_id="r"),
        }
        fuzz_unary_methods(aio, ch, "RewardService", methods, 40)
        aio.run(ch.close())
        assert call(address, "Score", rpb.ScoreRequest(response="7", answer="7")).reward == 1.0  # still scoring
    finally:
        stop_process(proc)


async def _open(address: str):
    return channel(address)
