"""`rollmesh bench gateway`: what the agent gateway costs and saves, under many concurrent agents.

The mesh as deployed, each service its own process (the embedded engine with the tiny model, the
LLMProxy, the SampleBuffer, the AsyncController, the gateway), and ``clients`` agents in this
process, each playing sessions of ``turns`` turns that share one long system prompt, for
``duration_s`` (it stops by itself). First the same conversations go straight to the LLMProxy
(the prompt rendered whole each turn, as a client without the gateway would), then through the
gateway (a session per conversation, ended with a reward, its group put into the buffer).

Reported: errors (any non-200 answer; must be 0), the latency the gateway adds at p50 and p99
(the difference of the two distributions at the same concurrency, and with one client), and
the prompt tokens the gateway rendered against those it reused from the sessions' prefix trees.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from launch.bench.proxy_bench import _cpu_s, _pct
from services.gateway.keys import issue_key
from services.processes import (
    free_port,
    start_engine_process,
    start_gateway_process,
    start_service_process,
    stop_process,
)

SYSTEM = (
    "You are a careful assistant inside a benchmark. Answer briefly; the harness checks nothing you say. "
) * 6  # about 600 characters every session shares


def _conversation(i: int, turns: int) -> list[str]:
    return [f"Question {k} of conversation {i}: what comes after {i + k}?" for k in range(turns)]


async def _direct(address: str, tokenizer, clients: int, turns: int, max_tokens: int, duration_s: float):
    from services.llm_proxy.client import ProxyClient

    client, lat, errors = ProxyClient(address, timeout_s=120), [], 0
    deadline = time.monotonic() + duration_s

    async def agent(c: int) -> None:
        nonlocal errors
        n = 0
        while time.monotonic() < deadline:
            messages = [{"role": "system", "content": SYSTEM}]
            for question in _conversation(c * 1000 + n, turns):
                messages.append({"role": "user", "content": question})
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
                t = time.perf_counter()
                try:
                    out = await client.generate(ids, max_tokens, temperature=1.0)
                except Exception:
                    errors += 1
                    break
                lat.append(time.perf_counter() - t)
                messages.append(
                    {"role": "assistant", "content": tokenizer.decode(out.output_ids, skip_special_tokens=True)}
                )
            n += 1

    try:
        await asyncio.gather(*(agent(c) for c in range(clients)))
    finally:
        await client.close()
    return lat, errors


async def _gateway(url: str, key: str, clients: int, turns: int, max_tokens: int, duration_s: float):
    import httpx

    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    http = httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=120, limits=limits)
    lat, errors, sessions = [], 0, 0
    rendered = reused = 0
    deadline = time.monotonic() + duration_s

    async def agent(c: int) -> None:
        nonlocal errors, sessions, rendered, reused
        n = 0
        while time.monotonic() < deadline:
            r = await http.post("/v1/sessions", json={})
            if r.status_code != 200:
                errors += 1
                continue
            sid, messages = r.json()["id"], [{"role": "system", "content": SYSTEM}]
            for question in _conversation(c * 1000 + n, turns):
                messages.append({"role": "user", "content": question})
                t = time.perf_counter()
                r = await http.post(
                    f"/sessions/{sid}/v1/chat/completions",
                    json={"model": "rollmesh-policy", "messages": messages, "max_tokens": max_tokens},
                )
                if r.status_code != 200:
                    errors += 1
                    break
                lat.append(time.perf_counter() - t)
                body = r.json()
                rendered += body["rollmesh"]["rendered_tokens"]
                reused += body["rollmesh"]["reused_tokens"]
                messages.append(body["choices"][0]["message"])
            r = await http.post(f"/v1/sessions/{sid}/end", json={"reward": 1.0})
            errors += r.status_code != 200
            sessions += 1
            n += 1

    try:
        await asyncio.gather(*(agent(c) for c in range(clients)))
    finally:
        await http.aclose()
    return lat, errors, sessions, rendered, reused


def run(
    model_path: str, clients: int = 200, duration_s: float = 60.0, turns: int = 3, max_tokens: int = 4, progress=print
) -> dict:

    import uvloop
    from transformers import AutoTokenizer

    from services.auth import AuthConfig, ensure_token

    auth = ensure_token(AuthConfig())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    procs = []
    try:
        engine, engine_url = start_engine_process(model_path, extra=["max_running_requests=256"])
        procs.append(engine)
        proxy, proxy_addr = start_service_process(
            "llm-proxy", "proxy", [f"engine_urls=[{engine_url}]", "metrics_port=0"]
        )
        procs.append(proxy)
        buf, buf_addr = start_service_process(
            "sample-buffer", "buffer", ["metrics_port=0", "backend=memory", "capacity_groups=1000000"]
        )
        procs.append(buf)
        # No trainer consumes: admission must never be the bottleneck being measured.
        ctl, ctl_addr = start_service_process(
            "controller",
            "controller",
            [
                "metrics_port=0",
                f"mesh.proxy={proxy_addr}",
                f"mesh.buffer={buf_addr}",
                "controller.groups_per_step=1000000",
                f"model_path={model_path}",
            ],
        )
        procs.append(ctl)
        wiring = [
            f"mesh.proxy={proxy_addr}",
            f"mesh.buffer={buf_addr}",
            f"mesh.controller={ctl_addr}",
            f"model_path={model_path}",
            f"max_concurrent_requests={clients + 8}",
        ]
        keys = Path(tempfile.mkdtemp(prefix="rollmesh-bench-gateway-")) / "keys.json"
        key = issue_key(keys, "bench")  # an agent's key of its own, as a deployment issues it
        gw, gw_url = start_gateway_process([*wiring, f"api_keys_path={keys}"], free_port(), auth=auth)
        procs.append(gw)
        progress(f"mesh up; {clients} agents x {turns} turns for {duration_s:g} s, straight to the LLMProxy")
        uvloop.run(_direct(proxy_addr, tokenizer, clients, turns, max_tokens, 2.0))  # warm-up
        direct, direct_errors = uvloop.run(_direct(proxy_addr, tokenizer, clients, turns, max_tokens, duration_s))
        progress(f"{len(direct)} direct requests; now through the gateway")
        cpu0 = _cpu_s(gw.pid)
        t0 = time.monotonic()
        via, errors, sessions, rendered, reused = uvloop.run(
            _gateway(gw_url, key, clients, turns, max_tokens, duration_s)
        )
        wall = time.monotonic() - t0
        cpu_per_request = (_cpu_s(gw.pid) - cpu0) / max(1, len(via))
        progress("one agent, each way")
        single_s = min(5.0, duration_s)
        one_direct, _ = uvloop.run(_direct(proxy_addr, tokenizer, 1, turns, max_tokens, single_s))
        one_via, *_ = uvloop.run(_gateway(gw_url, key, 1, turns, max_tokens, single_s))
    finally:
        for p in reversed(procs):
            stop_process(p)
    ms = 1000.0
    return {
        "clients": clients,
        "duration_s": duration_s,
        "turns": turns,
        "max_tokens": max_tokens,
        "errors": errors + direct_errors,
        "sessions": sessions,
        "requests": len(via),
        "direct_requests": len(direct),
        "requests_per_s": round(len(via) / wall, 1),
        "direct_p50_ms": round(_pct(direct, 0.5) * ms, 2),
        "direct_p99_ms": round(_pct(direct, 0.99) * ms, 2),
        "gateway_p50_ms": round(_pct(via, 0.5) * ms, 2),
        "gateway_p99_ms": round(_pct(via, 0.99) * ms, 2),
        "added_p50_ms": round((_pct(via, 0.5) - _pct(direct, 0.5)) * ms, 2),
        "added_p99_ms": round((_pct(via, 0.99) - _pct(direct, 0.99)) * ms, 2),
        "single_client_added_p50_ms": round((_pct(one_via, 0.5) - _pct(one_direct, 0.5)) * ms, 2),
        "gateway_cpu_ms_per_request": round(cpu_per_request * ms, 2),
        "tokens_rendered": rendered,
        "tokens_reused": reused,
        "reused_share": round(reused / max(1, rendered + reused), 3),
    }
