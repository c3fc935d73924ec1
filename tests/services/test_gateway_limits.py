"""What one key may hold of the gateway: refused prompts leave nothing behind, a session's and a key's
tokens are capped, a stream counts as in flight until its last chunk, stop strings are bounded."""

from __future__ import annotations

import asyncio

import httpx
import openai

from tests.services.test_gateway import USER, client, gateway

LONG = "seven " * 400  # ~400 tokens: over the prompt limit these tests set


async def _session(url: str, key: str = "key-alice") -> tuple[str, openai.AsyncOpenAI]:
    async with httpx.AsyncClient() as h:
        r = await h.post(f"{url}/v1/sessions", headers={"Authorization": f"Bearer {key}"}, json={}, timeout=30)
    r.raise_for_status()
    return r.json()["id"], openai.AsyncOpenAI(base_url=r.json()["base_url"], api_key=key, max_retries=0, timeout=60)


def test_refused_prompts_leave_nothing_in_a_session_and_its_tokens_are_capped(engine_url, tiny_model):
    """Refused prompts once entered the session's tree before their length was checked (~20 MB a
    request, kept). Now the tree holds only what was answered; a session's and a key's tokens are capped."""
    limits = {"max_prompt_tokens": 64, "sessions": {"max_session_tokens": 200, "max_key_tokens": 150}}

    async def main():
        async with gateway(engine_url, tiny_model, **limits) as (url, _, sessions):
            sid, c = await _session(url)
            refused = []
            for i in range(5):
                for call in (
                    c.completions.create(model="m", prompt=f"{i} {LONG}", max_tokens=4),
                    c.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{i} {LONG}"}]),
                ):
                    try:
                        await call
                    except openai.BadRequestError as e:
                        refused.append(e.body["param"])
            tree = sessions.sessions[sid].tree
            empty = (len(tree.roots), tree.tokens, sessions.held["alice"])
            answer = await c.completions.create(model="m", prompt="1 2 3", max_tokens=8)
            held = (tree.tokens, sessions.held["alice"], answer.usage.prompt_tokens + answer.usage.completion_tokens)
            errors = {}
            for name, client_, max_tokens in (("session", c, 195), ("key", (await _session(url))[1], 140)):
                try:  # 195 + the prompt passes the session's 200; 140 + what the first session holds, the key's 150
                    await client_.completions.create(model="m", prompt="1 2 3", max_tokens=max_tokens)
                except openai.APIStatusError as e:
                    errors[name] = (e.status_code, e.body["param"])
            return refused, empty, held, errors

    refused, empty, held, errors = asyncio.run(main())
    assert refused == ["messages"] * 10
    assert empty == (0, 0, 0)  # nothing of the refused requests is held
    assert held[0] == held[1] == held[2]  # the answered one: its prompt and its answer
    assert errors == {"session": (400, "session"), "key": (429, "session")}


def test_a_stream_is_in_flight_until_its_last_chunk(engine_url, tiny_model):
    """With one request in flight a key, a streamed answer that has started still holds the key's one
    slot (40 streams once ran at once under a limit of 4): another request is refused until it ends."""

    async def main():
        async with gateway(engine_url, tiny_model, max_concurrent_requests=1) as (url, mesh, _):
            c, other = client(url), client(url)
            stream = await c.chat.completions.create(
                model="m", messages=USER, max_tokens=256, stream=True, seed=3
            )  # seeded: unseeded, an early end of sequence left no content chunk to pause at, by chance
            refused_while, in_flight = None, None
            async for ch in stream:
                if refused_while is None and ch.choices and ch.choices[0].delta.content:
                    await mesh.proxy.suspend()  # the generation waits: the stream is mid-answer
                    in_flight = mesh.proxy.stats()["in_flight"]
                    try:
                        await other.completions.create(model="m", prompt="1 2", max_tokens=2)
                        refused_while = False
                    except openai.RateLimitError:
                        refused_while = True
                    await mesh.proxy.resume()
            after = await other.completions.create(model="m", prompt="1 2", max_tokens=2)
            await c.close()
            await other.close()
            return refused_while, in_flight, after

    refused_while, in_flight, after = asyncio.run(main())
    assert in_flight is not None, "the stream sent no content to pause at"
    assert in_flight == 1 and refused_while is True
    assert after.choices  # the slot came back with the stream's end


def test_a_long_stop_string_is_refused_by_name(engine_url, tiny_model):
    async def main():
        async with gateway(engine_url, tiny_model) as (url, _, _):
            c = client(url)
            try:
                await c.chat.completions.create(model="m", messages=USER, max_tokens=4, stop=["x" * 1025])
            except openai.BadRequestError as e:
                return e.body
            finally:
                await c.close()

    body = asyncio.run(main())
    assert body["param"] == "stop" and "1025 characters; at most 1024" in body["message"]
