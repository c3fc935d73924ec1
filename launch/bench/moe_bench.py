"""`rollmesh bench moe`: the engine–trainer mismatch routing replay removes, and what routing costs.

**Mismatch.** The embedded engine serves an MoE model in ``--engine-dtype`` (bfloat16: as SGLang
serves it) and samples answers to chat prompts, recording each position's experts; the trainer (float32,
as it trains) computes the same tokens' log-probs twice, routing freely and replaying the engine's
experts. Reported per generated token: |log μ − log π| (mean, p99, max) and the k3 estimate of
KL(μ ‖ π) each way, their ratio, and how often the engine and a float32 forward route a token to a
different set of experts (per token and MoE layer, and per token in any layer).

**Cost.** Bytes of routing per token (layers × top_k ids, one byte each up to 256 experts), and groups
through the real SampleBuffer service on Redis with and without it (``bench buffer``'s method) at the
routing size of a real model (default Qwen3-30B-A3B's 48 layers × top-8).
"""

from __future__ import annotations

import random
import string
import tempfile
import time
from pathlib import Path

import numpy as np


def _prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = lambda: " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(6))  # noqa: E731
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{words()}?"}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for _ in range(n)
    ]


def _token_stats(lp, behav, mask) -> dict:
    d = (lp - behav)[mask > 0]
    log_r = (lp - behav)[mask > 0]  # log π/μ on tokens sampled from μ: k3 estimates KL(μ ‖ π)
    a = d.abs()
    return {
        "abs_diff_mean": float(a.mean()),
        "abs_diff_p99": float(a.quantile(0.99)),
        "abs_diff_max": float(a.max()),
        "kl_k3": float((log_r.exp() - 1 - log_r).mean()),
    }


def mismatch(
    model: str,
    engine_dtype: str = "bfloat16",
    num_prompts: int = 64,
    max_new_tokens: int = 48,
    seed: int = 0,
    device: str = "cpu",
    progress=print,
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.engines.embedded.config import EngineConfig
    from rollout.engines.embedded.engine import EmbeddedEngine
    from rollout.engines.embedded.routing import RoutingCapture
    from rollout.sampling import SamplingParams
    from trainer.batch import batch_from_sequences
    from trainer.config import TrainerConfig
    from trainer.engine import TrainEngine

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = _prompts(tokenizer, num_prompts, seed)
    progress(f"engine ({engine_dtype}, {device}): {num_prompts} answers of up to {max_new_tokens} tokens")
    engine = EmbeddedEngine(EngineConfig(model_path=model, dtype=engine_dtype, device=device, max_running_requests=64))
    engine.start()
    try:
        sampling = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, sampling_seed=seed)
        futures = [
            engine.submit(
                f"m{i}", p, sampling.model_copy(update={"sampling_seed": seed + i}), return_routed_experts=True
            )
            for i, p in enumerate(prompts)
        ]
        outs = [f.result(600) for f in futures]
    finally:
        engine.shutdown()
    seqs = [p + o.output_ids for p, o in zip(prompts, outs, strict=True)]
    width = max(map(len, seqs))
    mask = torch.zeros(len(seqs), width)
    behav = torch.zeros(len(seqs), width)
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        mask[i, len(p) : len(seqs[i])] = 1
        behav[i, len(p) : len(seqs[i])] = torch.tensor(o.behavior_logprobs)
    batch = batch_from_sequences(seqs, mask, behav, torch.zeros(len(seqs)), torch.arange(len(seqs)))
    batch.routed_experts = [o.routed_experts for o in outs]

    out: dict = {"engine_dtype": engine_dtype, "trainer_dtype": "float32", "device": device}
    for routing in ("free", "replay"):
        progress(f"trainer (float32): log-probs, routing {routing}")
        trainer = TrainEngine(TrainerConfig(model_path=model, device=device, moe={"routing": routing}))
        out[routing] = _token_stats(trainer.logprobs(batch).cpu(), behav, mask)
        del trainer
    out["abs_diff_ratio"] = out["free"]["abs_diff_mean"] / max(out["replay"]["abs_diff_mean"], 1e-12)
    out["kl_ratio"] = out["free"]["kl_k3"] / max(out["replay"]["kl_k3"], 1e-12)

    progress("routing: the engine's against a float32 forward's")
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    capture = RoutingCapture(hf)
    layers, k = capture.moe_layers, capture.top_k
    differ_pairs = pairs = differ_tokens = 0
    with torch.no_grad():
        for seq, o in zip(seqs, outs, strict=True):
            hf(input_ids=torch.tensor([seq[:-1]], device=device))
            own = capture.take(1, len(seq) - 1)[0].reshape(len(seq) - 1, -1, k)[:, layers]
            got = o.routed_experts.reshape(len(seq) - 1, -1, k)[:, layers]
            differs = (np.sort(own, -1) != np.sort(got, -1)).any(-1)  # [positions, MoE layers]
            differ_pairs += int(differs.sum())
            pairs += differs.size
            differ_tokens += int(differs.any(-1).sum())
    out["routing_differs_share"] = differ_pairs / pairs  # (token, MoE layer) pairs
    out["routing_differs_token_share"] = differ_tokens / sum(len(s) - 1 for s in seqs)  # any layer
    out["generated_tokens"] = int(mask.sum())
    out["moe_layers"], out["top_k"], out["num_experts"] = len(layers), k, capture.num_experts
    return out


def cost(groups: int = 2000, group_size: int = 8, tokens: int = 512, routing_ids: int = 384, progress=print) -> dict:
    """Routing's bytes and the buffer's throughput with and without it."""
    from launch.bench import buffer_bench
    from sample_buffer.codec import decode_group

    out: dict = {"routing_ids_per_token": routing_ids, "routing_bytes_per_token": routing_ids}
    for name, ids in (("without", 0), ("with", routing_ids)):
        payload = buffer_bench.make_payloads(1, group_size, tokens, ids)[0]
        t = time.perf_counter()
        for _ in range(20):
            decode_group(payload)
        out[f"decode_ms_{name}"] = round((time.perf_counter() - t) / 20 * 1000, 3)
        progress(f"buffer: {groups} groups of {group_size} × {tokens} tokens, {name} routing")
        r = buffer_bench.run(groups, group_size, tokens, ids)
        out[f"group_bytes_{name}"] = r["payload_bytes"]
        out[f"groups_per_s_{name}"] = r["groups_per_s"]
        out[f"mb_per_s_{name}"] = r["mb_per_s"]
    out["throughput_ratio"] = round(out["groups_per_s_with"] / out["groups_per_s_without"], 3)
    return out


def run(
    model: str | None = None,
    engine_dtype: str = "bfloat16",
    num_prompts: int = 64,
    max_new_tokens: int = 48,
    groups: int = 2000,
    routing_ids: int = 384,
    device: str = "cpu",
    progress=print,
) -> dict:
    from launch.bench import BadOption
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    if engine_dtype not in ("float32", "bfloat16", "float16"):
        raise BadOption(f"--engine-dtype: float32, bfloat16 or float16, not {engine_dtype!r}")
    if device not in ("cpu", "cuda"):
        raise BadOption(f"--device: cpu or cuda, not {device!r}")
    for name, value in (("num-prompts", num_prompts), ("max-new-tokens", max_new_tokens), ("routing-ids", routing_ids)):
        if value < 1:
            raise BadOption(f"--{name}: must be >= 1, got {value}")
    if model is not None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model, local_files_only=True).get_text_config()
        if not any(getattr(config, k, 0) for k in ("num_experts", "num_local_experts")):
            raise BadOption(f"--model: {model} ({config.model_type}) has no mixture-of-experts layers")
    with tempfile.TemporaryDirectory(prefix="rollmesh-moe-") as tmp:
        if model is None:
            progress("building the tiny Qwen3-MoE (8 experts, top-2, 4 layers; random weights)")
            model = str(build_tiny_model(Path(tmp) / "moe", TinyModelConfig(arch="qwen3-moe")))
        out = {
            "model": model,
            **mismatch(model, engine_dtype, num_prompts, max_new_tokens, device=device, progress=progress),
        }
    if groups:
        out["cost"] = cost(groups, routing_ids=routing_ids, progress=progress)
    return out
