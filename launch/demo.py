"""``make run`` until the training loop lands: engine process → LLMProxy → a few chat prompts."""

from __future__ import annotations

import time

from rich.console import Console

from rollout.chat_turns import render_prompt
from rollout.proxy import ProxyConfig
from services.llm_proxy.client import ProxyClient
from services.llm_proxy.server import start_proxy
from services.processes import start_engine_process, stop_process

PROMPTS = ["What is 2+3?", "Name a color.", "Count to five.", "Say hello."]


async def run_demo(model_path: str) -> None:
    import asyncio

    from transformers import AutoTokenizer

    console = Console()
    tok = AutoTokenizer.from_pretrained(model_path)
    console.print(f"[bold]starting an embedded engine for[/] {model_path}")
    proc, url = start_engine_process(model_path)
    server = proxy = client = None
    try:
        server, proxy = await start_proxy(ProxyConfig(engine_urls=[url], port=0, metrics_port=0))
        client = ProxyClient(f"127.0.0.1:{server.bound_port}")
        console.print(f"engine at {url}, LLMProxy at 127.0.0.1:{server.bound_port}")
        t0 = time.perf_counter()
        calls = []
        for i, text in enumerate(PROMPTS):
            ids = render_prompt(tok, text)
            calls.append(client.generate(ids, 24, route=f"demo-{i}", temperature=1.0, sampling_seed=i))
        outs = await asyncio.gather(*calls)
        for text, out in zip(PROMPTS, outs):
            mean_lp = sum(out.behavior_logprobs) / max(1, len(out.behavior_logprobs))
            console.print(
                f"[cyan]{text}[/] → {tok.decode(out.output_ids)!r}  "
                f"({len(out.output_ids)} tokens, mean logprob {mean_lp:.2f}, version {out.weight_version})"
            )
        stats = await client.stats()
        wall = time.perf_counter() - t0
        console.print(
            f"{stats.requests_total} requests in {wall:.2f}s; engines in rotation: "
            f"{sum(e.healthy for e in stats.engines)}/{len(stats.engines)}"
        )
        console.print("(the tiny model is randomly initialised: its words are noise until it is trained)")
    finally:
        if client:
            await client.close()
        if server:
            await server.stop(1)
        if proxy:
            await proxy.close()
        stop_process(proc)
