"""Held-out evaluation through a real LLMProxy and engine: a slow answer is counted, not fatal."""

from __future__ import annotations

import asyncio
import json

from launch.config import load_config
from launch.evaluation import heldout_accuracy
from rollout.proxy import ProxyConfig
from services.llm_proxy.server import start_proxy


def test_heldout_answers_that_time_out_count_as_wrong_and_are_reported(engine_url, tiny_model, tmp_path):
    rows = tmp_path / "heldout.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"kq{d}x", "answer": str(d)}) + "\n" for d in range(6)))

    def cfg(timeout_s: float):
        sets = [
            f"model_path={tiny_model}",
            f"run.heldout_path={rows}",
            "env_manager.reward=exact_match",
            "env_manager.episode.sampling.max_new_tokens=200",
            f"run.heldout_timeout_s={timeout_s}",
        ]
        return load_config(None, sets)

    async def go():
        server, proxy = await start_proxy(ProxyConfig(engine_urls=[engine_url], port=0, metrics_port=0))
        try:
            address = f"127.0.0.1:{server.bound_port}"
            return await heldout_accuracy(address, cfg(0.001)), await heldout_accuracy(address, cfg(60))
        finally:
            await server.stop(0)
            await proxy.close()

    slow, ok = asyncio.run(go())
    assert slow.unanswered == 6 and slow.accuracy == 0.0 and "unanswered" in str(slow), slow
    assert "Timeout" in slow.first_error, slow.first_error
    assert ok.unanswered == 0 and 0.0 <= ok.accuracy <= 1.0 and str(ok) == f"{ok.accuracy:.3f}"
