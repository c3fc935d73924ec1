"""The agent gateway on loopback, driven by clients nobody here wrote (OpenAI's own ``openai``
package), in front of a real mesh: the LLMProxy, the AsyncController and the SampleBuffer over
gRPC, and the embedded engine running the tiny model in its own process."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import httpx
import openai
import pytest
import torch

from rollout.agent.render import TemplateRenderer
from rollout.agent.sessions import AgentSessions, SessionsConfig
from sample_buffer.codec import decode_group
from sample_buffer.vision import vision_of
from services.auth import AuthConfig
from services.gateway.config import GatewayConfig
from services.gateway.keys import KeyRing
from services.gateway.server import create_app
from services.http_limits import uvicorn_config
from services.llm_proxy.client import ProxyGenerate
from services.processes import free_port
from tests.services.mesh import local_mesh

KEYS = {"alice": "key-alice", "bob": "key-bob"}
TOOLS_TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "agent" / "chatml_tools.jinja"


@contextlib.asynccontextmanager
async def gateway(
    engine_url: str, model: str, *, controller: dict | None = None, template: str | None = None, **config
):
    """The mesh, and the gateway in front of it on a free port: yields (base URL, mesh, sessions)."""
    import uvicorn
    from transformers import AutoTokenizer

    controller = controller or {"async_ratio": 1, "groups_per_step": 4}
    async with local_mesh(engine_url, model, buffer={"filter_zero_variance": False}, **controller) as mesh:
        cfg = GatewayConfig(port=free_port(), **config)
        template = None if template == "own" else template or TOOLS_TEMPLATE.read_text()  # "own": the model's
        renderer = TemplateRenderer(AutoTokenizer.from_pretrained(model), template, vision_of(model))
        sessions = AgentSessions(
            cfg.sessions,
            renderer,
            ProxyGenerate(mesh.proxy_client),
            admission=mesh.controller_client,
            sink=mesh.buffer_client,
        )
        # served as the gateway is (its limits, a bounded wait for requests in flight at stop); of the
        # AuthConfig only TLS is read, the agents' keys are the KeyRing's
        app = create_app(sessions, cfg, KeyRing.of_keys(KEYS))
        server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", cfg.port, AuthConfig(disabled=True)))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{cfg.port}", mesh, sessions
        finally:
            server.should_exit = True
            await task


def client(url: str, key: str = "key-alice", **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)


USER = [{"role": "user", "content": "Add 3 and 4."}]


def test_the_openai_client_lists_chats_streams_and_completes(engine_url, tiny_model):
    async def main():
        async with gateway(engine_url, tiny_model) as (url, _, _):
            c = client(url)
            listed = [m async for m in c.models.list()]
            models = [m.id for m in listed]
            assert listed[0].created > 1_600_000_000, listed  # a Unix time (2020 on), not seconds since boot
            two = await c.chat.completions.create(
                model="rollmesh-policy", messages=USER, n=2, max_tokens=8, logprobs=True, seed=7
            )
            greedy = await c.chat.completions.create(
                model="rollmesh-policy", messages=USER, max_tokens=8, temperature=0
            )
            stream = await c.chat.completions.create(
                model="rollmesh-policy",
                messages=USER,
                max_tokens=8,
                temperature=0,
                stream=True,
                logprobs=True,
                stream_options={"include_usage": True},
            )
            chunks = [ch async for ch in stream]
            text = await c.completions.create(model="rollmesh-policy", prompt="1 2 3", max_tokens=5, logprobs=1)
            ids = await c.completions.create(model="rollmesh-policy", prompt=[49, 50, 51], max_tokens=3)
            sync = openai.OpenAI(base_url=url + "/v1", api_key="key-alice", max_retries=0, timeout=60)
            blocking = await asyncio.to_thread(
                sync.chat.completions.create, model="rollmesh-policy", messages=USER, max_tokens=4
            )
            await c.close()
            return models, two, greedy, chunks, text, ids, blocking

    models, two, greedy, chunks, text, ids, blocking = asyncio.run(main())
    assert models == ["rollmesh-policy"]
    assert len(two.choices) == 2 and two.usage.completion_tokens >= 2
    for ch in two.choices:
        assert ch.finish_reason in ("stop", "length") and ch.message.role == "assistant"
        assert len(ch.logprobs.content) >= 1 and all(t.logprob <= 0 for t in ch.logprobs.content)
    assert sum(len(ch.logprobs.content) for ch in two.choices) == two.usage.completion_tokens
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == greedy.choices[0].message.content  # the stream says what the answer says
    assert chunks[-1].usage.completion_tokens == greedy.usage.completion_tokens
    streamed_lps = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert len(streamed_lps) == greedy.usage.completion_tokens  # every token's log-prob, once
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == greedy.choices[0].finish_reason
    assert len(text.choices[0].logprobs.token_logprobs) == text.usage.completion_tokens
    assert ids.usage.prompt_tokens == 3 and blocking.choices[0].message.content is not None


def test_a_stream_sends_tokens_while_they_are_made(engine_url, tiny_model):
    """The first chunks arrive while the generation runs: the proxy is suspended after the first
    (the generation is still in flight), then resumed; the stream goes on across the pause."""

    async def main():
        async with gateway(engine_url, tiny_model) as (url, mesh, _):
            c = client(url)
            stream = await c.chat.completions.create(
                model="m",
                messages=USER,
                max_tokens=256,
                stream=True,
                stream_options={"include_usage": True},
                seed=3,  # sampled: unseeded, an early end of sequence left a chunk or two by chance
            )
            chunks, in_flight = [], None
            async for ch in stream:
                chunks.append(ch)
                if in_flight is None and ch.choices and ch.choices[0].delta.content:
                    await mesh.proxy.suspend()  # continue mode: the generation waits, then goes on
                    in_flight = mesh.proxy.stats()["in_flight"]
                    await asyncio.sleep(0.3)
                    await mesh.proxy.resume()
            await c.close()
            return chunks, in_flight

    chunks, in_flight = asyncio.run(main())
    assert in_flight == 1  # a chunk came before the generation ended
    content = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content) > 2 and chunks[-1].usage.completion_tokens > 2


def test_top_logprobs_are_each_positions_most_likely_tokens(engine_url, tiny_model):
    async def main():
        async with gateway(engine_url, tiny_model) as (url, _, _):
            c = client(url)
            chat = await c.chat.completions.create(
                model="m", messages=USER, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
            )
            text = await c.completions.create(model="m", prompt="1 2 3", max_tokens=4, temperature=0, logprobs=2)
            await c.close()
            return chat, text

    chat, text = asyncio.run(main())
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for t in content:  # greedy: the token is the most likely one, with its own log-prob
        top = [x.logprob for x in t.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
    tops = text.choices[0].logprobs.top_logprobs
    assert len(tops) == text.usage.completion_tokens and all(len(top) == 2 for top in tops)


def test_a_tool_agents_second_turn_renders_with_the_models_own_template(engine_url, tiny_model):
    """LangChain sends the assistant's tool-call turn back with content null (or none at all); the
    model's own template reads message['content'] unconditionally and failed on it (a 400)."""
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    async def main():
        async with gateway(engine_url, tiny_model, template="own") as (url, _, _):
            c, answers = client(url), []
            for assistant in (
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "assistant", "tool_calls": [call]},
            ):
                messages = [*USER, assistant, {"role": "tool", "tool_call_id": "c1", "content": "7"}]
                answers.append(await c.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=3))
            return answers

    answers = asyncio.run(main())  # answered, not refused (sampled: an early end of answer is the model's)
    assert [len(a.choices) for a in answers] == [1, 1]
    assert all(a.choices[0].finish_reason in ("length", "stop") and a.usage.completion_tokens <= 3 for a in answers)


def test_bad_requests_get_openais_errors_and_the_gateway_keeps_serving(engine_url, tiny_model):
    async def main():
        limits = dict(max_completion_tokens=64, max_concurrent_requests=1, max_request_bytes=65_536)
        async with gateway(engine_url, tiny_model, **limits) as (
            url,
            mesh,
            _,
        ):
            c, errors = client(url), {}
            for name, call in {
                "key": lambda: client(url, "wrong").chat.completions.create(model="m", messages=USER),
                "temperature": lambda: c.chat.completions.create(model="m", messages=USER, temperature=5),
                "top_logprobs": lambda: c.chat.completions.create(model="m", messages=USER, top_logprobs=3),
                "tool_choice": lambda: c.chat.completions.create(
                    model="m", messages=USER, max_tokens=4, tool_choice="required"
                ),
                "tool_choice.function.name": lambda: c.chat.completions.create(
                    model="m",
                    messages=USER,
                    max_tokens=4,
                    tool_choice={"type": "function", "function": {"name": "mul"}},
                    tools=[{"type": "function", "function": {"name": "add", "parameters": {}}}],
                ),
                "tools": lambda: c.chat.completions.create(
                    model="m",
                    messages=USER,
                    max_tokens=4,
                    tool_choice="required",
                    tools=[{"type": "function", "function": {"name": "add", "parameters": {"type": "frob"}}}],
                ),
                "max_tokens": lambda: c.chat.completions.create(model="m", messages=USER, max_tokens=10_000),
                "role": lambda: c.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}]),
                "messages": lambda: c.chat.completions.create(model="m", messages=[]),
                "response_format": lambda: c.chat.completions.create(
                    model="m", messages=USER, response_format={"type": "xml"}
                ),
                "response_format.json_schema.schema": lambda: c.chat.completions.create(  # one with no grammar
                    model="m",
                    messages=USER,
                    max_tokens=4,
                    response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "frob"}}},
                ),
                "session": lambda: c.chat.completions.create(
                    model="m", messages=USER, extra_headers={"x-rollmesh-session": "sess-nope"}
                ),
                "image": lambda: c.chat.completions.create(  # to a text-only model
                    model="m",
                    max_tokens=4,
                    messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
                ),
            }.items():
                try:
                    await call()
                except openai.APIStatusError as e:
                    errors[name] = (e.status_code, e.body)
            # A key's requests in flight are bounded: one waits behind a suspended proxy, the next is refused.
            await mesh.proxy.suspend()
            held = asyncio.create_task(c.chat.completions.create(model="m", messages=USER, max_tokens=4))
            await asyncio.sleep(0.5)
            try:
                await c.chat.completions.create(model="m", messages=USER, max_tokens=4)
            except openai.RateLimitError as e:
                errors["limit"] = (e.status_code, e.body)
            other = await client(url, "key-bob").models.list()  # another key is not held up
            await mesh.proxy.resume()
            after = await held
            async with httpx.AsyncClient(headers={"authorization": "Bearer key-alice"}) as http:
                errors["route"] = (await http.get(url + "/v1/nope")).json()
                ended = await http.post(url + "/v1/sessions", json={})
                sid = ended.json()["id"]
                await http.post(f"{url}/v1/sessions/{sid}/end", json={"reward": 0.0})
                again = await http.post(f"{url}/v1/sessions/{sid}/end", json={"reward": 0.0})
                errors["ended"] = (again.status_code, again.headers.get("x-should-retry"))

                async def chunks():  # no Content-Length: the old check let 40 MiB like this be read in full
                    for _ in range(16):
                        yield b" " * 8192

                big = await http.post(url + "/v1/chat/completions", content=chunks())
                errors["chunked"] = (big.status_code, big.json())
            return errors, after, other

    errors, after, other = asyncio.run(main())
    assert errors["key"][0] == 401 and errors["key"][1]["code"] == "invalid_api_key"
    fields = ("temperature", "top_logprobs", "tool_choice", "max_tokens", "messages", "response_format")
    for field in (*fields, "tool_choice.function.name", "tools", "response_format.json_schema.schema"):
        status, body = errors[field]
        assert status == 400 and body["param"] == field and body["type"] == "invalid_request_error", (field, body)
    assert errors["role"][0] == 400 and "wizard" in errors["role"][1]["message"]
    assert errors["response_format.json_schema.schema"][1]["message"].endswith('Unsupported type "frob"')
    assert errors["session"][0] == 404
    status, body = errors["image"]
    assert status == 400 and body["param"] == "messages[0].content[0].image_url", body
    assert "takes no images" in body["message"]
    assert errors["limit"][0] == 429
    assert errors["route"]["error"]["type"] == "invalid_request_error"  # an unknown route: OpenAI's shape too
    assert errors["ended"] == (404, "false")  # an ended session is gone; OpenAI's client must not retry
    status, body = errors["chunked"]
    assert status == 413 and "over this route's 65536 bytes" in body["error"]["message"], body
    assert after.choices[0].message is not None and other.data[0].id == "rollmesh-policy"


def teacher_forced_logprobs(model_path: str, token_ids: list[int]) -> torch.Tensor:
    """log p(token t | tokens before it) under the model, for t = 1..T-1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids[1:])[:, None])[:, 0]


def test_sessions_become_token_exact_groups_and_forks_share_their_prefix(engine_url, tiny_model):
    async def main():
        async with gateway(engine_url, tiny_model) as (url, mesh, sessions):
            http = httpx.AsyncClient(headers={"authorization": "Bearer key-alice"}, timeout=30)
            made = [
                (await http.post(url + "/v1/sessions", json={"group": "g-1", "group_size": 2})).json() for _ in range(2)
            ]
            stranger = await http.get(f"{url}/v1/sessions/{made[0]['id']}", headers={"authorization": "Bearer key-bob"})
            answers = []
            for i, s in enumerate(made):  # an unmodified client: only its base_url names the session
                c = openai.AsyncOpenAI(base_url=s["base_url"], api_key="key-alice", max_retries=0)
                first = await c.chat.completions.create(model="m", messages=USER, max_tokens=6, seed=i)
                turn = [
                    *USER,
                    first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "Again."},
                ]
                second = await c.chat.completions.create(model="m", messages=turn, max_tokens=6, seed=i)
                answers.append((first, second))
                if i == 1:  # the agent rewrites its last message: a branch beside the first
                    edited = [*turn[:-1], {"role": "user", "content": "Once more."}]
                    await c.chat.completions.create(model="m", messages=edited, max_tokens=6, seed=i)
            ended = [
                (await http.post(f"{url}/v1/sessions/{s['id']}/end", json={"reward": float(i)})).json()
                for i, s in enumerate(made)
            ]
            batch = await mesh.buffer_client.get(1, 0, 1, timeout_s=5.0)
            await http.aclose()
            return made, stranger, answers, ended, batch

    made, stranger, answers, ended, batch = asyncio.run(main())
    assert stranger.status_code == 404 and stranger.json()["error"]["param"] == "session"
    assert [e["group_state"] for e in ended] == ["waiting", "put"]
    for first, second in answers:  # the second request reused everything the first consumed and produced
        assert (
            second.model_extra["rollmesh"]["reused_tokens"] == first.usage.prompt_tokens + first.usage.completion_tokens
        )
    [group] = [decode_group(g) for g in batch.groups]
    trajs = sorted(group.trajectories, key=lambda t: (t.reward, t.trajectory_id))
    assert group.group_id == "g-1" and [t.reward for t in trajs] == [0.0, 1.0, 1.0]  # session 2 forked
    a, b = trajs[1:]
    first_answer_end = next(i for i in range(a.metadata["turn_starts"][0], len(a.loss_mask)) if not a.loss_mask[i])
    assert a.metadata["turn_starts"][0] == b.metadata["turn_starts"][0]
    assert list(a.token_ids[:first_answer_end]) == list(b.token_ids[:first_answer_end])  # the shared prefix
    assert list(a.token_ids) != list(b.token_ids)
    for t in trajs:  # token-exact: the model, teacher-forced on the trajectory, gives the engine's log-probs
        ids, mask = [int(x) for x in t.token_ids], [int(x) for x in t.loss_mask]
        forced = teacher_forced_logprobs(tiny_model, ids)
        generated = torch.tensor([forced[i - 1].item() for i in range(1, len(ids)) if mask[i]])
        assert len(generated) == len(t.behavior_logprobs) == sum(mask)
        assert torch.allclose(generated, torch.tensor(t.behavior_logprobs, dtype=torch.float32), atol=2e-3)


def test_a_group_waits_for_a_slot_under_the_staleness_bound(engine_url, tiny_model):
    async def main():
        controller = {"async_ratio": 0, "groups_per_step": 1}
        async with gateway(
            engine_url, tiny_model, controller=controller, sessions=SessionsConfig(admit_timeout_s=0.5)
        ) as (url, _, _):
            http = httpx.AsyncClient(headers={"authorization": "Bearer key-alice"}, timeout=30)
            first = await http.post(url + "/v1/sessions", json={})
            refused = await http.post(url + "/v1/sessions", json={})
            await http.post(f"{url}/v1/sessions/{first.json()['id']}/end", json={"reward": 1.0})  # nothing generated
            third = await http.post(url + "/v1/sessions", json={})
            metrics = (await http.get(url + "/metrics")).text
            await http.aclose()
            return first, refused, third, metrics

    first, refused, third, metrics = asyncio.run(main())
    assert first.status_code == 200 and third.status_code == 200  # the empty group's slot came back
    assert refused.status_code == 503 and "async_ratio" in refused.json()["error"]["message"]
    assert 'rollmesh_gateway_events_total{event="admit_refused"} 1.0' in metrics
    assert 'rollmesh_gateway_events_total{event="groups_empty"} 1.0' in metrics


def test_an_abandoned_group_is_not_trained_and_gives_its_slot_back(engine_url, tiny_model):
    """A member failed (a verifiers rollout's error): the agent gives its group up. Its answered
    sessions are not stored, its slot comes back at once, and its sessions are gone."""

    async def main():
        controller = {"async_ratio": 0, "groups_per_step": 1}
        async with gateway(
            engine_url, tiny_model, controller=controller, sessions=SessionsConfig(admit_timeout_s=0.5)
        ) as (url, _, _):
            http = httpx.AsyncClient(headers={"authorization": "Bearer key-alice"}, timeout=30)
            a = (await http.post(url + "/v1/sessions", json={"group": "g", "group_size": 2})).json()
            b = (await http.post(url + "/v1/sessions", json={"group": "g", "group_size": 2})).json()
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            answered = await http.post(a["base_url"] + "/chat/completions", json=chat)
            await http.post(f"{url}/v1/sessions/{a['id']}/reward", json={"reward": 1.0})
            other = await http.post(url + "/v1/sessions", headers={"authorization": "Bearer key-bob"}, json={})
            given_up = await http.post(f"{url}/v1/sessions/{b['id']}/abandon")
            again = await http.post(f"{url}/v1/sessions/{a['id']}/abandon")
            ended = await http.post(f"{url}/v1/sessions/{a['id']}/end", json={"reward": 1.0})
            next_group = await http.post(url + "/v1/sessions", json={})
            metrics = (await http.get(url + "/metrics")).text
            await http.aclose()
            return answered, other, given_up, again, ended, next_group, metrics

    answered, other, given_up, again, ended, next_group, metrics = asyncio.run(main())
    assert answered.status_code == 200
    assert other.status_code == 503  # the one slot is the group's while it is open
    assert given_up.status_code == 200 and given_up.json()["group_state"] == "abandoned"
    assert again.status_code == 404 and ended.status_code == 404  # its sessions are gone
    assert next_group.status_code == 200  # the slot came back, unused
    assert 'rollmesh_gateway_events_total{event="groups_abandoned"} 1.0' in metrics
    assert 'rollmesh_gateway_events_total{event="trajectories_put"} 0.0' in metrics


def test_tools_reach_the_template(engine_url, tiny_model):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    async def main():
        async with gateway(engine_url, tiny_model) as (url, _, _):
            c = client(url)
            plain = await c.chat.completions.create(model="m", messages=USER, max_tokens=1)
            with_tools = await c.chat.completions.create(model="m", messages=USER, max_tokens=1, tools=tools)
            hidden = await c.chat.completions.create(
                model="m", messages=USER, max_tokens=1, tools=tools, tool_choice="none"
            )
            return plain, with_tools, hidden

    plain, with_tools, hidden = asyncio.run(main())
    schema = len(json.dumps(tools[0]))
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + schema  # byte-level: a token per byte
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.fixture(scope="module")
def agent_tools():
    from agents import function_tool
    from agents.models.chatcmpl_converter import Converter

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    return add, [Converter.tool_to_openai(add)]


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory, agent_tools):
    from tests.services.agent_model import build_tool_agent_model

    return build_tool_agent_model(tmp_path_factory.mktemp("agent-model"), agent_tools[1])


async def sdk_session_model(http: httpx.AsyncClient, url: str):
    """A new gateway session, and the Agents SDK's chat-completions model bound to it."""
    from agents import OpenAIChatCompletionsModel

    made = (await http.post(url + "/v1/sessions", json={})).json()
    client = openai.AsyncOpenAI(base_url=made["base_url"], api_key="key-alice", max_retries=0)
    return made, OpenAIChatCompletionsModel(model="rollmesh-policy", openai_client=client)


def test_an_agents_sdk_agent_runs_its_tool_loop_and_its_session_is_trained_token_exact(
    agent_model, agent_tools, engine_pool
):
    from agents import Agent, ModelSettings, Runner, set_tracing_disabled

    from tests.services.agent_model import INSTRUCTIONS, TEMPLATE

    set_tracing_disabled(True)  # tracing would export to OpenAI's servers
    add, _ = agent_tools
    proc, url_engine = engine_pool.start(agent_model, [])

    async def main():
        async with gateway(url_engine, agent_model, template=TEMPLATE) as (url, mesh, sessions):
            http = httpx.AsyncClient(headers={"authorization": "Bearer key-alice"}, timeout=30)
            made, model = await sdk_session_model(http, url)
            agent = Agent(
                name="adder",
                instructions=INSTRUCTIONS,
                tools=[add],
                model=model,
                model_settings=ModelSettings(temperature=0.0, max_tokens=128),
            )
            result = await Runner.run(agent, "Add 3 and 4.", max_turns=4)
            state = (await http.get(f"{url}/v1/sessions/{made['id']}")).json()
            await http.post(f"{url}/v1/sessions/{made['id']}/end", json={"reward": 1.0})
            batch = await mesh.buffer_client.get(1, 0, 1, timeout_s=5.0)
            # The same agent streaming: the SDK reads the answer and the tool call from the chunks.
            made, agent.model = await sdk_session_model(http, url)
            run = Runner.run_streamed(agent, "Add 3 and 4.", max_turns=4)
            deltas = [e async for e in run.stream_events() if e.type == "raw_response_event"]
            streamed_state = (await http.get(f"{url}/v1/sessions/{made['id']}")).json()
            await http.aclose()
            return result, state, batch, sessions.counters, run, deltas, streamed_state

    try:
        result, state, batch, counters, run, deltas, streamed_state = asyncio.run(main())
    finally:
        engine_pool.give_back(agent_model, [], proc, url_engine)
    assert run.final_output == "The sum is 7." and len(deltas) > 2
    assert [item.output for item in run.new_items if item.type == "tool_call_output_item"] == [7]
    assert streamed_state["requests"] == 2 and streamed_state["branches"] == 1  # the streamed turns chain too
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert len(calls) == 1 and outputs == [7]  # the SDK called the tool the model asked for
    assert result.final_output == "The sum is 7."
    assert state["requests"] == 2 and state["branches"] == 1  # two turns, one conversation
    assert counters["tokens_reused"] > 0
    [group] = [decode_group(g) for g in batch.groups]
    [traj] = group.trajectories
    ids, mask = [int(x) for x in traj.token_ids], [int(x) for x in traj.loss_mask]
    assert len(traj.metadata["turn_starts"]) == 2
    forced = teacher_forced_logprobs(agent_model, ids)
    generated = torch.tensor([forced[i - 1].item() for i in range(1, len(ids)) if mask[i]])
    assert torch.allclose(generated, torch.tensor(traj.behavior_logprobs, dtype=torch.float32), atol=2e-3)


def test_an_agents_sdk_agent_that_forces_its_tool_call_is_trained_a_step_through_the_gateway(
    agent_model, agent_tools, engine_pool
):
    """The Agents SDK's ``tool_choice="required"``: the first turn is decoded under the call's
    grammar (the SDK then lets the model answer freely: ``reset_tool_choice``). The session is
    trained a step: the constrained turn's masks are replayed, the free one's tokens left as they are."""
    from agents import Agent, ModelSettings, Runner, set_tracing_disabled

    from tests.services.agent_model import INSTRUCTIONS, TEMPLATE
    from trainer.batch import batch_from_groups
    from trainer.config import TrainerConfig
    from trainer.engine import TrainEngine

    set_tracing_disabled(True)  # tracing would export to OpenAI's servers
    add, _ = agent_tools
    proc, url_engine = engine_pool.start(agent_model, [])

    async def main():
        async with gateway(url_engine, agent_model, template=TEMPLATE) as (url, mesh, _):
            http = httpx.AsyncClient(headers={"authorization": "Bearer key-alice"}, timeout=30)
            made, model = await sdk_session_model(http, url)
            settings = ModelSettings(temperature=0.0, max_tokens=128, tool_choice="required")
            agent = Agent(name="adder", instructions=INSTRUCTIONS, tools=[add], model=model, model_settings=settings)
            result = await Runner.run(agent, "Add 3 and 4.", max_turns=4)
            await http.post(f"{url}/v1/sessions/{made['id']}/end", json={"reward": 1.0})
            batch = await mesh.buffer_client.get(1, 0, 1, timeout_s=5.0)
            await http.aclose()
            return result, batch

    try:
        result, batch = asyncio.run(main())
    finally:
        engine_pool.give_back(agent_model, [], proc, url_engine)
    assert [item.output for item in result.new_items if item.type == "tool_call_output_item"] == [7]
    assert result.final_output == "The sum is 7."
    [group] = [decode_group(g) for g in batch.groups]
    [traj] = group.trajectories
    forced, free = traj.metadata["turn_grammars"]
    assert forced[0] == "ebnf" and "<tool_call>" in forced[1] and free is None
    train = batch_from_groups([group])
    eng = TrainEngine(TrainerConfig(model_path=agent_model, lr=1e-3))
    out = eng.train_step(train)
    first_turn = traj.metadata["turn_starts"][1] - traj.metadata["turn_starts"][0]
    assert 0 < out["grammar_tokens"] <= first_turn and out["grammar_tokens_excluded"] == 0
    assert out["tokens"] == traj.num_generated  # a group of one: its advantage is 0, but every token is in the step


def test_a_langgraph_react_agent_runs_its_tool_loop_with_the_models_own_template(agent_model, engine_pool):
    """LangGraph's ReAct agent over langchain-openai's ChatOpenAI, plain and streamed, with the
    chat template the model itself ships; LangChain's structured output (a JSON schema, JSON mode, a
    forced function call) and ``bind_tools(tool_choice="any")`` are decoded under their grammars."""
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent
    from pydantic import BaseModel

    from tests.services.agent_model import INSTRUCTIONS

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    class Sum(BaseModel):
        total: int

    proc, url_engine = engine_pool.start(agent_model, [])

    async def main():
        async with gateway(url_engine, agent_model, template="own") as (url, _, _):
            http = httpx.AsyncClient(headers={"authorization": "Bearer key-alice"}, timeout=30)
            runs = []
            for streaming in (False, True):
                made = (await http.post(url + "/v1/sessions", json={})).json()
                llm = ChatOpenAI(
                    model="rollmesh-policy",
                    base_url=made["base_url"],
                    api_key="key-alice",
                    temperature=0.0,
                    max_tokens=128,
                    max_retries=0,
                    timeout=60,  # a turn that hangs fails here, naming the call, not at the test's timeout
                    streaming=streaming,
                )
                agent = create_react_agent(llm, [add], prompt=INSTRUCTIONS)
                runs.append(await agent.ainvoke({"messages": [("user", "Add 3 and 4.")]}))
                state = (await http.get(f"{url}/v1/sessions/{made['id']}")).json()
                assert state["requests"] == 2 and state["branches"] == 1, state  # two turns, one conversation
            llm = ChatOpenAI(
                model="rollmesh-policy", base_url=url + "/v1", api_key="key-alice", max_retries=0, timeout=60
            )
            shaped = [
                await llm.with_structured_output(Sum, method=method).ainvoke("Add 3 and 4.")
                for method in ("json_schema", "function_calling")
            ]
            # JSON mode holds the answer to an object, not to a schema (OpenAI's too): a dict, not a Sum
            shaped.append(await llm.with_structured_output(Sum.model_json_schema(), method="json_mode").ainvoke("3+4"))
            forced = await llm.bind_tools([add], tool_choice="any").ainvoke([("user", "Add 3 and 4.")])
            await http.aclose()
            return runs, shaped, forced

    try:
        runs, shaped, forced = asyncio.run(main())
    finally:
        engine_pool.give_back(agent_model, [], proc, url_engine)
    for run in runs:
        tools = [m for m in run["messages"] if isinstance(m, ToolMessage)]
        assert [t.content for t in tools] == ["7"], run["messages"]  # the graph ran the tool the model asked for
        final = run["messages"][-1]
        assert isinstance(final, AIMessage) and final.content == "The sum is 7.", final
    assert [type(x) for x in shaped] == [Sum, Sum, dict], shaped  # parsed by LangChain into the schema's class
    assert [c["name"] for c in forced.tool_calls] == ["add"] and set(forced.tool_calls[0]["args"]) == {"a", "b"}


SUM_SCHEMA = {
    "type": "object",
    "properties": {"total": {"type": "integer"}, "sure": {"type": "boolean"}},
    "required": ["total", "sure"],
    "additionalProperties": False,
}


def test_answers_follow_their_response_format_and_forced_calls_are_trained_on_policy(agent_model, engine_pool):
    """OpenAI's client asks for a JSON schema, JSON mode and forced tool calls (``required`` and a
    named function): every answer follows its form. The session's turns record their grammars, and
    a training step on it replays their masks: π equals the engine's μ on every constrained token."""
    import jsonschema

    from tests.services.agent_model import INSTRUCTIONS
    from trainer.batch import batch_from_groups
    from trainer.config import TrainerConfig
    from trainer.engine import TrainEngine

    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            },
        }
    ]
    first = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Add 3 and 4."}]
    proc, url_engine = engine_pool.start(agent_model, [])

    async def main():
        async with gateway(url_engine, agent_model, template="own") as (url, mesh, _):
            c = client(url)
            fmt = {"type": "json_schema", "json_schema": {"name": "sum", "schema": SUM_SCHEMA, "strict": True}}
            shaped = await c.chat.completions.create(
                model="m", messages=USER, response_format=fmt, max_tokens=48, n=3, seed=1
            )
            mode = await c.chat.completions.create(
                model="m", messages=USER, response_format={"type": "json_object"}, max_tokens=48, seed=2
            )
            http = httpx.AsyncClient(headers={"authorization": "Bearer key-alice"}, timeout=30)
            made = (await http.post(url + "/v1/sessions", json={})).json()
            s = openai.AsyncOpenAI(base_url=made["base_url"], api_key="key-alice", max_retries=0, timeout=60)
            messages, calls = list(first), []
            for choice in ("required", {"type": "function", "function": {"name": "add"}}):
                answer = await s.chat.completions.create(
                    model="m", messages=messages, tools=tools, tool_choice=choice, max_tokens=96, temperature=0.8
                )
                msg = answer.choices[0].message
                calls.append((answer.choices[0].finish_reason, msg.tool_calls))
                messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": "c", "content": "7"}]
            await http.post(f"{url}/v1/sessions/{made['id']}/end", json={"reward": 1.0})
            batch = await mesh.buffer_client.get(1, 0, 1, timeout_s=5.0)
            await http.aclose()
            return shaped, mode, calls, batch

    try:
        shaped, mode, calls, batch = asyncio.run(main())
    finally:
        engine_pool.give_back(agent_model, [], proc, url_engine)
    for choice in shaped.choices:
        jsonschema.validate(json.loads(choice.message.content), SUM_SCHEMA)
    assert isinstance(json.loads(mode.choices[0].message.content), dict)
    for reason, tool_calls in calls:  # a call every turn, though the model's script ends its second with text
        assert reason == "tool_calls" and [t.function.name for t in tool_calls] == ["add"]
        assert set(json.loads(tool_calls[0].function.arguments)) == {"a", "b"}
    [group] = [decode_group(g) for g in batch.groups]
    [traj] = group.trajectories
    assert [g[0] for g in traj.metadata["turn_grammars"]] == ["ebnf", "ebnf"]
    train = batch_from_groups([group])
    eng = TrainEngine(TrainerConfig(model_path=agent_model, lr=1e-3))
    m = train.loss_mask.bool()
    assert (eng.logprobs(train) - train.behavior_logprobs)[m].abs().max() < 2e-3  # on-policy under the masks
    out = eng.train_step(train)
    assert out["grammar_tokens"] == traj.num_generated and out["grammar_tokens_excluded"] == 0
