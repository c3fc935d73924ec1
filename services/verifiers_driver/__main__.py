"""A verifiers environment's own rollouts against the mesh's policy, through the agent gateway.

``rollmesh run`` starts this in place of the EnvManager where ``env_manager.env`` is ``{type:
verifiers}``, with the interpreter of the environment's own venv (verifiers' dependencies, mcp<2
and its openai and datasets pins, cannot share the mesh's): ``python -m services.verifiers_driver
SPEC.json``. It imports only the standard library, httpx and verifiers.

Each group is one row of the environment's dataset played ``group_size`` times: ``group_size``
gateway sessions, then the library's own ``env.run_group`` (its prompt with system prompt and
few-shot, its turns and ``env_response``, its tools, its parser and rubric) over one OpenAI client
whose requests each name their member's session (``x-rollmesh-session``). The gateway renders each
request through the session's prefix tree, so the policy's tokens are trained as generated
(token-in/token-out). Each session ends with the rubric's reward; a member whose rollout failed
(the library's ``state["error"]``) abandons its whole group: no reward is invented for it. Every
played rollout is logged as a JSON line (``rollouts_log``): prompt, completion, reward, session.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import sys
import time
import uuid
from urllib.parse import urlparse

import httpx

log = logging.getLogger("verifiers-driver")
SESSION_HEADER = "x-rollmesh-session"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def load(spec: dict):
    """The environment, as ``verifiers.load_environment`` loads it (an installed package, or a module
    on ``path``), and refused by name where it needs what this mesh cannot give it."""
    sys.path[:0] = spec.get("path") or []
    import verifiers as vf

    if not hasattr(vf, "load_environment"):
        raise SystemExit(
            f"verifiers {vf.__version__} has no classic Environment API (load_environment); "
            "env_manager.env.python must be a venv with verifiers<0.4"
        )
    env = vf.load_environment(spec["name"], **spec.get("args", {}))
    refuse(env)
    return vf, env


def refuse(env) -> None:
    """Environments that call out of this machine: a hosted sandbox (SandboxEnv, PythonEnv run code on
    Prime's) or a judge model elsewhere (a JudgeRubric's client defaults to OpenAI's API)."""
    kinds = {c.__name__ for c in type(env).__mro__}
    if hosted := kinds & {"SandboxEnv", "PythonEnv", "CliAgentEnv"}:
        raise SystemExit(f"env_manager.env: {sorted(hosted)[0]} runs its code in a hosted sandbox; not supported")
    for rubric in [env.rubric, *getattr(env.rubric, "rubrics", [])]:
        judge = getattr(rubric, "judge_client", None)
        url = str(getattr(judge, "base_url", ""))
        if judge is not None and urlparse(url).hostname not in LOOPBACK:
            raise SystemExit(
                f"env_manager.env: its {type(rubric).__name__} asks the judge model at {url}, off this machine "
                "(a judge is served here: its judge_client's base_url on loopback)"
            )


def session_client(vf, spec: dict, key: str, http_client=None):
    """One client for a group: each request carries its member's session (from the rollout's input)."""
    from openai import AsyncOpenAI

    try:
        from verifiers.clients import OpenAIChatCompletionsClient
    except ImportError:  # verifiers < 0.2
        OpenAIChatCompletionsClient = vf.OpenAIChatCompletionsClient

    class Routed(OpenAIChatCompletionsClient):
        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            session = kwargs["state"]["input"]["rollmesh_session"]
            kwargs["extra_headers"] = {**(kwargs.get("extra_headers") or {}), SESSION_HEADER: session}
            return await super().get_native_response(prompt, model, sampling_args, tools, **kwargs)

    timeout = httpx.Timeout(spec["request_timeout_s"], connect=10.0)
    return Routed(
        AsyncOpenAI(
            base_url=spec["gateway"] + "/v1", api_key=key, max_retries=0, timeout=timeout, http_client=http_client
        )
    )


async def open_sessions(http: httpx.AsyncClient, size: int, deadline: float) -> tuple[str, list[str]]:
    group, ids = f"vf-{uuid.uuid4().hex[:12]}", []
    for _ in range(size):
        while True:  # 503: no rollout slot under the staleness bound yet
            r = await http.post("/v1/sessions", json={"group": group, "group_size": size})
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        r.raise_for_status()
        ids.append(r.json()["id"])
    return group, ids


async def play(http, vf, env, client, row: dict, spec: dict, out) -> str:
    """One group: its sessions, the library's rollouts and rubric, the sessions ended with its rewards."""
    size = spec["group_size"]
    group, sessions = await open_sessions(http, size, time.monotonic() + spec["request_timeout_s"])
    inputs = [{**row, "rollmesh_session": s} for s in sessions]
    try:
        outputs = await env.run_group(inputs, client, spec["model"], dict(spec["sampling_args"]))
    except Exception as e:
        log.warning("group failed in the environment: %s: %s", type(e).__name__, e)
        outputs = None
    failed = outputs is None or any(o.get("error") or not _finite(o.get("reward")) for o in outputs)
    if failed:
        for s in sessions:
            await http.post(f"/v1/sessions/{s}/abandon")
        return "abandoned"
    state = "waiting"
    for s, o in zip(sessions, outputs, strict=True):
        out.write(json.dumps({"group": group, "session": s, **_logged(o)}, default=_plain) + "\n")
        r = await http.post(f"/v1/sessions/{s}/end", json={"reward": float(o["reward"])})
        r.raise_for_status()
        state = r.json()["group_state"]
    out.flush()
    return state


def _finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def _plain(x):
    """The library's messages are pydantic models: logged as their fields."""
    return x.model_dump(exclude_none=True) if hasattr(x, "model_dump") else str(x)


def _logged(o: dict) -> dict:
    keep = ("prompt", "completion", "answer", "reward", "metrics", "example_id")
    return {k: o.get(k) for k in keep}


async def main(spec: dict) -> None:
    vf, env = load(spec)
    with open(spec["key_file"]) as f:
        key = f.read().strip()
    rows = list(env.get_dataset())
    rng = random.Random(spec.get("seed", 0))
    client = session_client(vf, spec, key)
    headers = {"Authorization": f"Bearer {key}"}
    timeout = httpx.Timeout(spec["request_timeout_s"], connect=10.0)
    counts: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=spec["gateway"], headers=headers, timeout=timeout) as http:
        with open(spec["rollouts_log"], "a") as out:

            async def worker() -> None:
                while True:
                    state = await play(http, vf, env, client, rng.choice(rows), spec, out)
                    counts[state] = counts.get(state, 0) + 1
                    if sum(counts.values()) % 10 == 0:
                        log.info("groups: %s", counts)

            workers = [asyncio.create_task(worker()) for _ in range(spec["concurrency"])]
            done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
            for w in workers:
                w.cancel()
            for w in done:
                if isinstance(w.exception(), httpx.TransportError):  # the gateway went away: the run ended
                    log.info("the gateway is gone; groups: %s", counts)
                    return
                w.result()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    asyncio.run(main(spec))
