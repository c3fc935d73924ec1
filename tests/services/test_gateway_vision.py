"""OpenAI's image parts through the agent gateway to a vision-language policy: the engine sees the
pictures, a session's trajectories record the prompt as the model read it (each picture's
placeholder expanded) with the pictures stored once per group, the trainer's forward over them
gives the engine's log-probs, and bad images are refused by field while the gateway keeps serving."""

from __future__ import annotations

import asyncio
import base64

import httpx
import openai

from sample_buffer.codec import decode_group
from sample_buffer.vision import content_hash, image_bytes, vision_of
from tests.rollout.test_engine_vision import png
from tests.services.test_gateway import client, gateway
from trainer.batch import batch_from_groups
from trainer.config import TrainerConfig
from trainer.engine import TrainEngine

PICTURE, OTHER = png(28, 28, 1), png(36, 20, 2)


def shown(picture: str, text: str = "Which digit?") -> dict:
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": picture}}, {"type": "text", "text": text}],
    }


def test_image_parts_reach_the_engine_and_sessions_train_as_the_engine_saw_them(make_engine_process, tiny_vl):
    _, engine = make_engine_process(model=tiny_vl)

    async def main():
        async with gateway(engine, tiny_vl, template="own") as (url, mesh, sessions):
            c = client(url)
            greedy = {  # outside a session: the answer's log-probs depend on the picture
                p: await c.chat.completions.create(
                    model="m", messages=[shown(p)], max_tokens=3, temperature=0, logprobs=True
                )
                for p in (PICTURE, OTHER)
            }
            http = httpx.AsyncClient(headers={"authorization": "Bearer key-alice"}, timeout=60)
            made = [
                (await http.post(url + "/v1/sessions", json={"group": "pics", "group_size": 2})).json()
                for _ in range(2)
            ]
            for i, s in enumerate(made):  # both shown one picture; the first shown another on its second turn
                sc = openai.AsyncOpenAI(base_url=s["base_url"], api_key="key-alice", max_retries=0, timeout=60)
                first = await sc.chat.completions.create(model="m", messages=[shown(PICTURE)], max_tokens=4, seed=i)
                if i == 0:
                    turn = [
                        shown(PICTURE),
                        first.choices[0].message.model_dump(exclude_none=True),
                        shown(OTHER, "And?"),
                    ]
                    second = await sc.chat.completions.create(model="m", messages=turn, max_tokens=4, seed=i)
                await http.post(f"{url}/v1/sessions/{s['id']}/end", json={"reward": float(i)})
            batch = await mesh.buffer_client.get(1, 0, 1, timeout_s=10.0)
            await http.aclose()
            return greedy, first, second, batch

    greedy, first, second, batch = asyncio.run(main())
    vision = vision_of(tiny_vl)
    per_image = {p: vision.measure([image_bytes(p)])[0].tokens for p in (PICTURE, OTHER)}
    lps = [[t.logprob for t in r.choices[0].logprobs.content] for r in greedy.values()]
    assert lps[0] != lps[1]  # the engine read the pictures, not just their placeholders
    # usage counts the prompt as the model read it: the picture expanded
    assert greedy[PICTURE].usage.prompt_tokens == first.usage.prompt_tokens
    assert second.model_extra["rollmesh"]["reused_tokens"] == first.usage.prompt_tokens + first.usage.completion_tokens
    [group] = [decode_group(g) for g in batch.groups]
    a, b = sorted(group.trajectories, key=lambda t: t.reward)
    hashes = {p: content_hash(image_bytes(p)) for p in (PICTURE, OTHER)}
    assert a.images == (hashes[PICTURE], hashes[OTHER]) and b.images == (hashes[PICTURE],)
    assert set(group.images) == set(hashes.values())  # each picture once for the group
    pad = vision.image_token_id
    assert list(a.token_ids).count(pad) == per_image[PICTURE] + per_image[OTHER]
    assert list(b.token_ids).count(pad) == per_image[PICTURE]
    # token-in/token-out: the trainer's forward over the recorded ids with the pictures is the engine's
    trainer = TrainEngine(TrainerConfig(model_path=tiny_vl))
    batch = batch_from_groups([group])
    mask = batch.loss_mask.bool()
    gap = (trainer.logprobs(batch)[mask] - batch.behavior_logprobs[mask]).abs().max().item()
    assert gap <= 1e-4, gap


def test_bad_images_are_refused_by_field_and_the_gateway_keeps_serving(make_engine_process, tiny_vl):
    _, engine = make_engine_process(model=tiny_vl)
    from io import BytesIO

    from PIL import Image

    huge = BytesIO()
    Image.new("RGB", (4200, 4200)).save(huge, format="PNG")  # small to send, 17.6 M pixels to decode
    cases = {
        "remote": [shown("https://example.com/digit.png")],
        "type": [shown("data:text/plain;base64," + base64.b64encode(b"hello").decode())],
        "corrupt": [shown("data:image/png;base64," + base64.b64encode(b"\x89PNG not really").decode())],
        "pixels": [shown("data:image/png;base64," + base64.b64encode(huge.getvalue()).decode())],
        "placeholder": [{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>Which digit?"}],
        "role": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": PICTURE}}]}, shown(PICTURE)],
        "missing": [{"role": "user", "content": [{"type": "image_url", "image_url": "not an object"}]}],
        "aspect": [shown(png(300, 1, 3))],  # Qwen2-VL's processor takes no aspect ratio over 200
    }

    async def main():
        async with gateway(engine, tiny_vl, template="own") as (url, _, _):
            c, errors = client(url), {}
            for name, messages in cases.items():
                try:
                    await c.chat.completions.create(model="m", messages=messages, max_tokens=2)
                except openai.BadRequestError as e:
                    errors[name] = e.body
            after = await c.chat.completions.create(model="m", messages=[shown(PICTURE)], max_tokens=2)
            return errors, after

    errors, after = asyncio.run(main())
    assert set(errors) == set(cases), errors
    part = "messages[0].content[0].image_url"
    for name in ("remote", "type", "corrupt", "pixels", "missing"):
        assert errors[name]["param"].startswith(part), (name, errors[name])
    assert "not downloaded" in errors["remote"]["message"]
    assert "data URL must be data:image/" in errors["type"]["message"]
    assert "not a readable" in errors["corrupt"]["message"]
    assert "pixels is over" in errors["pixels"]["message"]
    assert errors["placeholder"]["param"] == "messages" and "1 image placeholders" in errors["placeholder"]["message"]
    assert "user messages" in errors["role"]["message"]
    assert errors["aspect"]["param"] == "messages" and "image processor refused" in errors["aspect"]["message"]
    assert after.choices[0].message.content is not None
