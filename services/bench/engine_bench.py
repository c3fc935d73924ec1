"""`rollmesh bench engine`: continuous batching vs static-batch HF generate on long-tailed lengths.

Both sides generate the same response lengths for the same prompts: each response stops at its
own length (as if EOS came there). Static batches run until their longest member ends, so the
tokens generated past a shorter member's end are wasted; that waste is what continuous batching
removes. Throughput counts only the requested tokens on both sides.
"""

from __future__ import annotations

import asyncio
import random
import time

import torch

from services.launch import start_engine_process, stop_process


def workload(num_prompts: int, max_new_tokens: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts of 8-48 tokens and lognormal response lengths (median ~16, long tail), capped."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 48))] for _ in range(num_prompts)]
    lengths = [max(1, min(max_new_tokens, round(rng.lognormvariate(2.8, 1.0)))) for _ in range(num_prompts)]
    return prompts, lengths


async def _engine_run(url: str, prompts, lengths) -> float:
    from services.llm_proxy.server import engine_client

    client = engine_client(url, timeout_s=600)
    t0 = time.perf_counter()
    outs = await asyncio.gather(
        *(
            client.generate(p, {"max_new_tokens": n, "ignore_eos": True, "temperature": 1.0}, return_logprob=True)
            for p, n in zip(prompts, lengths)
        )
    )
    wall = time.perf_counter() - t0
    await client.close()
    assert [len(o.output_ids) for o in outs] == lengths
    return wall


def _hf_run(model, prompts, lengths, batch_size: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, want = prompts[i : i + batch_size], lengths[i : i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(want),
                min_new_tokens=max(want),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                pad_token_id=0,
            )
    return time.perf_counter() - t0


def run(model_path: str, num_prompts: int = 256, max_new_tokens: int = 128, batch_size: int = 64) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    prompts, lengths = workload(num_prompts, max_new_tokens, vocab)
    useful = sum(lengths)

    proc, url = start_engine_process(model_path, extra=[f"engine.max_running_requests={batch_size}"])
    try:
        asyncio.run(_engine_run(url, prompts[:16], lengths[:16]))  # warm-up
        engine_wall = asyncio.run(_engine_run(url, prompts, lengths))
    finally:
        stop_process(proc)

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    _hf_run(model, prompts[:16], lengths[:16], batch_size)  # warm-up
    hf_wall = _hf_run(model, prompts, lengths, batch_size)
    return {
        "num_prompts": num_prompts,
        "useful_tokens": useful,
        "p50_len": sorted(lengths)[len(lengths) // 2],
        "max_len": max(lengths),
        "embedded_wall_s": round(engine_wall, 3),
        "hf_generate_wall_s": round(hf_wall, 3),
        "embedded_tokens_per_s": round(useful / engine_wall, 1),
        "hf_generate_tokens_per_s": round(useful / hf_wall, 1),
        "speedup": round(hf_wall / engine_wall, 3),
    }
