"""`rollmesh bench grammar`: what constrained decoding costs the embedded engine.

The same chat prompts (a request for a tool call) are sampled twice in one engine, without a
grammar and under a tool call's JSON schema (``json_schema``): tokens per second of each, the
engine's time in masking (xgrammar's bitmask filled per constrained row, applied to the logits),
the schema's compile time (cold, then cached), whether every constrained answer parses and
follows the schema; then the trainer's side (``TrainEngine``): what replaying the answers' masks and
applying them in its forward cost per 1,000 constrained tokens, and how far its π is from μ with
the masks (the engines' numerics) and without (what the trainer computed before it replayed them).
"""

from __future__ import annotations

import json
import time

CITIES = ["Paris", "Lima", "Osaka", "Cairo", "Oslo", "Quito", "Perth", "Dakar", "Hanoi", "Bern", "Accra", "Riga"]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


def _prompts(tokenizer, n: int) -> list[list[int]]:
    ask = "What is the weather in {} right now? Answer with a get_weather call as JSON: name and arguments."
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": ask.format(CITIES[i % len(CITIES)])}],
            add_generation_prompt=True,
            return_dict=True,
        )["input_ids"]
        for i in range(n)
    ]


def run(model: str, num_prompts: int, max_new_tokens: int, progress=print) -> dict:
    from transformers import AutoTokenizer

    from rollout.engines.embedded.config import EngineConfig
    from rollout.engines.embedded.engine import EmbeddedEngine
    from rollout.engines.embedded.grammar import Grammars
    from rollout.sampling import SamplingParams

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    prompts = _prompts(tok, num_prompts)
    engine = EmbeddedEngine(EngineConfig(model_path=model)).start()
    try:
        schema = json.dumps(SCHEMA)
        constrained = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, json_schema=schema)
        t0 = time.perf_counter()
        fresh = Grammars(tok, engine.vocab_size, sorted(engine.eos_ids))
        tokenizer_info_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        fresh.compile_within(constrained)
        compile_cold_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        fresh.compile_within(constrained)
        compile_cached_s = time.perf_counter() - t0

        grammars = engine.grammars
        masking = {"s": 0.0}
        inner = grammars.masked

        def timed(logits, matchers):
            t = time.perf_counter()
            try:
                return inner(logits, matchers)
            finally:
                masking["s"] += time.perf_counter() - t

        grammars.masked = timed  # the engine's time in masking, for this bench only

        def sample(params: SamplingParams, tag: str) -> tuple[list, float]:
            t = time.perf_counter()
            futures = [engine.submit(f"{tag}{i}", p, params) for i, p in enumerate(prompts)]
            outs = [f.result(600) for f in futures]
            return outs, time.perf_counter() - t

        free = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
        sample(free, "warm")  # the first forwards of a fresh process are slower
        plain, plain_s = sample(free, "plain")
        masking["s"] = 0.0
        steps_before = engine.counters["decode_steps"] + engine.counters["prefill_batches"]
        tool, tool_s = sample(constrained, "tool")
        steps = engine.counters["decode_steps"] + engine.counters["prefill_batches"] - steps_before
        progress(f"plain {sum(len(o.output_ids) for o in plain)} tokens in {plain_s:.1f} s")
        progress(f"constrained {sum(len(o.output_ids) for o in tool)} tokens in {tool_s:.1f} s")

        valid = 0
        for o in tool:
            text = tok.decode(o.output_ids[:-1]) if o.finish_reason.get("type") == "stop" else ""
            try:
                call = json.loads(text)
                valid += call["name"] == "get_weather" and call["arguments"]["unit"] in ("celsius", "fahrenheit")
            except (ValueError, KeyError, TypeError):
                pass

    finally:
        engine.shutdown()
    trainer = _trainer_side(model, prompts, tool, schema, progress)
    plain_tokens = sum(len(o.output_ids) for o in plain)
    tool_tokens = sum(len(o.output_ids) for o in tool)
    return {
        "model": model,
        "prompts": num_prompts,
        "max_new_tokens": max_new_tokens,
        "plain_tokens_per_s": round(plain_tokens / plain_s, 1),
        "constrained_tokens_per_s": round(tool_tokens / tool_s, 1),
        "constrained_vs_plain": round((tool_tokens / tool_s) / (plain_tokens / plain_s), 3),
        "plain_mean_tokens": round(plain_tokens / num_prompts, 1),
        "constrained_mean_tokens": round(tool_tokens / num_prompts, 1),
        "masking_ms_per_step": round(1000 * masking["s"] / max(1, steps), 3),
        "masking_share_of_constrained_wall": round(masking["s"] / tool_s, 3),
        "answers_valid": valid,
        "tokenizer_info_s": round(tokenizer_info_s, 3),
        "compile_cold_ms": round(1000 * compile_cold_s, 2),
        "compile_cached_ms": round(1000 * compile_cached_s, 3),
        **trainer,
    }


def _trainer_side(model: str, prompts: list, answers: list, schema: str, progress) -> dict:
    """The trainer's cost of staying on-policy under the grammar: replaying the answers' masks
    (``TrainEngine.replay_grammars``) and applying them in its forward, per 1,000 constrained
    tokens; and how far its π is from the engine's μ with the masks and without."""
    import torch

    from sample_buffer.trajectory import Group, Trajectory
    from trainer.batch import batch_from_groups
    from trainer.config import TrainerConfig
    from trainer.engine import TrainEngine

    trajs = []
    for i, (p, o) in enumerate(zip(prompts, answers, strict=True)):
        n = len(o.output_ids)
        meta = {"turn_starts": [len(p)], "turn_temperatures": [1.0], "turn_grammars": [["json_schema", schema]]}
        ids, mask = [*p, *o.output_ids], [0] * len(p) + [1] * n
        trajs.append(Trajectory(f"g/{i}", "g", "p", ids, mask, o.behavior_logprobs, [0] * n, 0.0, 0, metadata=meta))
    eng = TrainEngine(TrainerConfig(model_path=model, micro_batch_tokens=8192))
    eng.replay_grammars(batch_from_groups([Group("g", "p", trajs[:1])]))  # the tokenizer's info, once a run
    batch = batch_from_groups([Group("g", "p", trajs)])
    t = time.perf_counter()
    counts = eng.replay_grammars(batch)
    replay_s = time.perf_counter() - t
    m = batch.loss_mask.bool()
    free = batch_from_groups([Group("g", "p", trajs)])
    free.grammar_spans = free.grammar_tags = None
    eng.logprobs(batch)  # warm
    masked_s, unmasked_s = float("inf"), float("inf")
    for _ in range(3):  # alternating, the fastest of each: one forward's noise is the gap's size here
        t = time.perf_counter()
        masked = eng.logprobs(batch)
        masked_s = min(masked_s, time.perf_counter() - t)
        t = time.perf_counter()
        unmasked = eng.logprobs(free)
        unmasked_s = min(unmasked_s, time.perf_counter() - t)
    tokens = counts["grammar_tokens"]
    progress(f"trainer: {int(tokens)} constrained tokens replayed in {replay_s:.2f} s")
    gap = lambda lp: (lp - batch.behavior_logprobs)[m].abs()  # noqa: E731
    return {
        "trainer_replay_ms_per_1k_tokens": round(1e6 * replay_s / max(1, tokens), 1),
        "trainer_masked_forward_extra_ms_per_1k_tokens": round(1e6 * (masked_s - unmasked_s) / max(1, tokens), 1),
        "trainer_forward_ms_per_1k_tokens": round(1e6 * unmasked_s / max(1, batch.num_tokens), 1),
        "pi_mu_gap_masked_max": float(f"{float(gap(masked).max()):.2e}"),
        "pi_mu_gap_unmasked_mean": round(float(gap(unmasked).mean()), 4),
        "trainer_excluded_tokens": int(counts["grammar_tokens_excluded"]),
        "torch_threads": torch.get_num_threads(),
    }
