"""`rollmesh bench engine`: the embedded engine, vLLM and static-batch HF generate, side by side on
the same long-tailed lengths.

Both sides generate the same response lengths for the same prompts: each response stops at its
own length (as if EOS came there). Static batches run until their longest member ends, so the
tokens generated past a shorter member's end are wasted; that waste is what continuous batching
removes. Throughput counts only the requested tokens on every side. vLLM runs from its own
environment (``make vllm``) with its defaults (torch.compile on), at the same running batch.

It also reports the train/inference mismatch of each engine: the engine's returned log-probs of
the first 16 responses against a teacher-forced forward of the same tokens (what the trainer
computes), mean and max |Δ|. And the embedded engine as a teacher (on-policy distillation): every
response scored, prompt as context (``/generate`` with ``logprob_start_len``, all at once), in
scored tokens a second, beside the tokens a second it generated them at.
"""

from __future__ import annotations

import asyncio
import random
import time

import torch

from services.processes import start_engine_process, stop_process


def workload(num_prompts: int, max_new_tokens: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts of 8-48 tokens and lognormal response lengths (median ~16, long tail), capped."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 48))] for _ in range(num_prompts)]
    lengths = [max(1, min(max_new_tokens, round(rng.lognormvariate(2.8, 1.0)))) for _ in range(num_prompts)]
    return prompts, lengths


async def _engine_run(url: str, prompts, lengths, api: str = "sglang"):
    from services.llm_proxy.server import engine_client

    client = engine_client(url, timeout_s=600, api=api)
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
    return wall, outs


async def _score_run(url: str, prompts, outs) -> float:
    """Seconds to score every response with its prompt as context (a teacher's calls, all at once)."""
    from services.llm_proxy.server import engine_client

    client = engine_client(url, timeout_s=600)
    t0 = time.perf_counter()
    scored = await asyncio.gather(*(client.score(p + o.output_ids, len(p)) for p, o in zip(prompts, outs)))
    wall = time.perf_counter() - t0
    await client.close()
    assert [len(s.logprobs) for s in scored] == [len(o.output_ids) for o in outs]
    return wall


def mismatch(model, prompts, outs) -> dict:
    """Mean and max |engine log-prob − teacher-forced log-prob| over the tokens of ``outs``."""
    deltas = []
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ids = torch.tensor([prompt + out.output_ids], device=model.device)
            logp = torch.log_softmax(model(ids).logits[0].float(), -1).cpu()
        ref = logp[len(prompt) - 1 : -1].gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
        deltas += (ref - torch.tensor(out.behavior_logprobs)).abs().tolist()
    return {"mean": float(f"{sum(deltas) / len(deltas):.3g}"), "max": float(f"{max(deltas):.3g}")}


def _served(model_path: str, extra: list[str], prompts, lengths, api: str = "sglang", score: bool = False):
    """Start an engine, warm it up, time the workload; (wall seconds, outputs, seconds to score the
    outputs as a teacher: with ``score``, else None)."""
    proc, url = start_engine_process(model_path, extra=extra, timeout_s=600)
    try:
        warm = asyncio.run(_engine_run(url, prompts[:16], lengths[:16], api))[1]
        wall, outs = asyncio.run(_engine_run(url, prompts, lengths, api))
        if not score:
            return wall, outs, None
        asyncio.run(_score_run(url, prompts[:16], warm))
        return wall, outs, asyncio.run(_score_run(url, prompts, outs))
    finally:
        stop_process(proc, 30)


def _hf_run(model, prompts, lengths, batch_size: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, want = prompts[i : i + batch_size], lengths[i : i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
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
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run(
    model_path: str,
    num_prompts: int = 256,
    max_new_tokens: int = 128,
    batch_size: int = 64,
    vllm: bool = True,
    progress=print,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict:
    """``device``/``dtype``: of the embedded engine and of HF generate alike (vLLM keeps its own)."""
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    from launch.bench import BadOption

    if not (Path(model_path) / "config.json").exists():  # never a hub name: nothing is downloaded
        raise BadOption(f"--model: no model at {model_path} (make model builds models/tiny)")

    if vllm:
        from rollout.engines.vllm.config import VLLMEngineConfig
        from services.engine.vllm_server import VLLMNotInstalled, interpreter

        try:
            interpreter(VLLMEngineConfig())
        except VLLMNotInstalled as e:
            raise BadOption(f"--vllm: {e} (or leave vLLM out: --no-vllm)") from None
    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    prompts, lengths = workload(num_prompts, max_new_tokens, vocab)
    useful = sum(lengths)
    walls, outs = {}, {}
    progress(f"embedded engine: {num_prompts} prompts, {useful} tokens")
    embedded = [f"max_running_requests={batch_size}", f"device={device}", f"dtype={dtype}"]
    walls["embedded"], outs["embedded"], score_wall = _served(model_path, embedded, prompts, lengths, score=True)
    if vllm:
        progress("vLLM (starting takes a minute or two)")
        extra = ["type=vllm", f"max_running_requests={batch_size}", f"context_length={48 + max_new_tokens + 16}"]
        walls["vllm"], outs["vllm"], _ = _served(model_path, extra, prompts, lengths, "vllm")
    progress("HF generate")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    _hf_run(model, prompts[:16], lengths[:16], batch_size)  # warm-up
    walls["hf_generate"] = _hf_run(model, prompts, lengths, batch_size)
    result = {
        "model": model_path,
        "device": device,
        "dtype": dtype,
        "num_prompts": num_prompts,
        "useful_tokens": useful,
        "p50_len": sorted(lengths)[len(lengths) // 2],
        "max_len": max(lengths),
        **{f"{k}_wall_s": round(w, 3) for k, w in walls.items()},
        **{f"{k}_tokens_per_s": round(useful / w, 1) for k, w in walls.items()},
        "speedup": round(walls["hf_generate"] / walls["embedded"], 3),  # embedded vs HF generate
        # the embedded engine as a teacher: the same responses scored, prompt as context
        "embedded_score_wall_s": round(score_wall, 3),
        "embedded_score_tokens_per_s": round(useful / score_wall, 1),
        "embedded_score_vs_generate": round(walls["embedded"] / score_wall, 3),
    }
    if vllm:
        result["embedded_vs_vllm"] = round(walls["vllm"] / walls["embedded"], 3)
    for name, o in outs.items():
        result[f"{name}_logprob_mismatch"] = mismatch(model, prompts[:16], o[:16])
    return result
