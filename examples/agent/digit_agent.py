"""An external agent that rollmesh trains: a plain OpenAI client, a checker tool, up to two turns.

It plays the quickstart's task (find the digit hidden in "kq7x") as a conversation: it asks the
policy, checks the answer with its tool, and if the answer is wrong says so and asks once more.
Each conversation is a session of the agent gateway; the 8 sessions of one prompt form a group;
each session ends with the agent's reward (1 right at once, 0.5 right on the second try, 0.1 a
wrong digit, 0 anything else). rollmesh trains on them and the agent's reward rises.

    rollmesh run examples/agent/train_agent.yaml &      # issues this run's agent key: RUN_DIR/agent.key
    python examples/agent/digit_agent.py --url http://127.0.0.1:8070 --key-file runs/agent/agent.key

It stops when the gateway goes away (the run ended) or after --groups groups, and prints its
mean reward per 50 groups as it goes (JSON lines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import uuid
from pathlib import Path

import httpx
import openai

TRAIN = Path(__file__).resolve().parents[1] / "find_digit_train.jsonl"


def check(answer: str, expected: str) -> str:
    """The agent's tool: right, wrong (a digit, but not this one) or not an answer."""
    answer = answer.strip()
    return "right" if answer == expected else "wrong" if answer.isdigit() else "invalid"


async def episode(session: dict, key: str, prompt: str, expected: str) -> float:
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=key, max_retries=3, timeout=120)
    messages = [{"role": "user", "content": prompt}]
    verdict = "invalid"
    try:
        for turn in range(2):
            reply = await client.chat.completions.create(
                model="rollmesh-policy", messages=messages, max_tokens=1, temperature=1.0
            )
            answer = reply.choices[0].message.content or ""
            verdict = check(answer, expected)
            if verdict == "right":
                return 1.0 if turn == 0 else 0.5
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "No. Try again."}]
    finally:
        await client.close()
    return 0.1 if verdict == "wrong" else 0.0


async def group(http: httpx.AsyncClient, key: str, row: dict, size: int) -> list[float]:
    gid = f"digit-{uuid.uuid4().hex[:12]}"
    sessions = []
    for _ in range(size):
        while True:  # 503: no rollout slot under the staleness bound yet
            r = await http.post("/v1/sessions", json={"group": gid, "group_size": size})
            if r.status_code != 503:
                break
            await asyncio.sleep(0.5)
        r.raise_for_status()
        sessions.append(r.json())
    rewards = await asyncio.gather(*(episode(s, key, row["prompt"], row["answer"]) for s in sessions))
    for s, reward in zip(sessions, rewards, strict=True):
        (await http.post(f"/v1/sessions/{s['id']}/end", json={"reward": reward})).raise_for_status()
    return list(rewards)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8070", help="The agent gateway.")
    ap.add_argument("--key-file", type=Path, help="File holding the gateway key (what `rollmesh run` writes).")
    ap.add_argument("--key", default=os.environ.get("ROLLMESH_AGENT_KEY"), help="The key ($ROLLMESH_AGENT_KEY).")
    ap.add_argument("--concurrency", type=int, default=16, help="Groups played at once.")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups", type=int, default=0, help="Stop after this many groups (0: when the run ends).")
    args = ap.parse_args()
    if args.key_file:
        args.key = args.key_file.read_text().strip()
    if not args.key:
        ap.error("give the gateway key: --key-file RUN_DIR/agent.key, --key or $ROLLMESH_AGENT_KEY")
    rows = [json.loads(line) for line in TRAIN.read_text().splitlines() if line.strip()]
    http = httpx.AsyncClient(base_url=args.url, headers={"authorization": f"Bearer {args.key}"}, timeout=120)
    done, window, stop = 0, [], asyncio.Event()

    async def worker() -> None:
        nonlocal done
        while not stop.is_set() and (not args.groups or done < args.groups):
            try:
                rewards = await group(http, args.key, random.choice(rows), args.group_size)
            except (httpx.HTTPError, openai.APIError) as e:
                try:
                    (await http.get("/health", timeout=5)).raise_for_status()
                except httpx.HTTPError:
                    stop.set()  # the gateway is gone: the run is over
                    return
                print(f"group failed, playing on: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                continue
            done += 1
            window.extend(rewards)
            if done % 50 == 0:
                print(json.dumps({"groups": done, "reward_mean": round(sum(window) / len(window), 3)}), flush=True)
                window.clear()

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    await http.aclose()


if __name__ == "__main__":
    asyncio.run(main())
