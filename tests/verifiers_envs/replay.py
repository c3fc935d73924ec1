"""Replays a verifiers run's logged rollouts through the library itself (``python replay.py SPEC.json
ROLLOUTS.jsonl``, in the verifiers venv): each logged group is played again by ``env.run_group`` with
the driver's own client, whose requests are answered by the logged assistant messages of their
session, in order. Prints one JSON line per rollout: the session, the logged reward and the one the
library computes now for the same completions."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import defaultdict

import httpx

from services.verifiers_driver.__main__ import SESSION_HEADER, load, session_client


def answers(rollouts: list[dict]) -> dict[str, list[str]]:
    return {r["session"]: [m["content"] for m in r["completion"] if m["role"] == "assistant"] for r in rollouts}


def transport(replies: dict[str, list[str]]) -> httpx.MockTransport:
    def reply(request: httpx.Request) -> httpx.Response:
        text = replies[request.headers[SESSION_HEADER]].pop(0)
        return httpx.Response(
            200,
            json={
                "id": "replay",
                "object": "chat.completion",
                "created": 0,
                "model": "replay",
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            },
        )

    return httpx.MockTransport(reply)


async def main(spec: dict, rollouts: list[dict]) -> None:
    vf, env = load(spec)
    rows = {row["example_id"]: row for row in env.get_dataset()}
    client = session_client(vf, spec, "replay", httpx.AsyncClient(transport=transport(answers(rollouts))))
    groups = defaultdict(list)
    for r in rollouts:
        groups[r["group"]].append(r)
    for members in groups.values():
        inputs = [{**rows[r["example_id"]], "rollmesh_session": r["session"]} for r in members]
        outputs = await env.run_group(inputs, client, spec["model"], dict(spec["sampling_args"]))
        for r, o in zip(members, outputs, strict=True):
            print(json.dumps({"session": r["session"], "logged": r["reward"], "library": o["reward"]}))


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    with open(sys.argv[2]) as f:
        rollouts = [json.loads(line) for line in f]
    asyncio.run(main(spec, rollouts))
