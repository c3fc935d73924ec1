"""`rollmesh bench trainer` prints its JSON line (tokens/s; MFU and GPU memory only on a GPU), and
the Qwen2-0.5B shape it builds for a GPU has Qwen2-0.5B's parameter count."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tests.cli import rollmesh


def _bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launch.cli", "bench", "trainer", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _refused(*args: str):
    return rollmesh("bench", "trainer", *args)


def test_bench_trainer_prints_throughput_in_mixed_precision_with_checkpointing():
    proc = _bench("--steps", "1", "--trajectories", "16", "--mixed-precision", "--activation-checkpointing", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["shape"] == "tiny" and out["mixed_precision"] is True
    assert out["train_tokens_per_s"] > 0 and out["unpacked_tokens_per_s"] > 0 and out["tokens_per_step"] > 16 * 32
    if not torch.cuda.is_available():  # no GPU: no peak to compare with, no GPU memory
        assert out["device"] == "cpu" and out["mfu"] is None and out["peak_gpu_mem_gb"] is None
    else:
        assert out["device"].startswith("cuda") and out["peak_gpu_mem_gb"] > 0


def test_bench_trainer_refuses_an_unknown_shape():
    res = _refused("--shape", "llama-70b")
    assert res.exit_code == 2 and "--shape: one of" in res.stderr


def test_the_qwen2_half_billion_shape_has_its_parameter_count():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.tiny_model import SHAPES, count_parameters

    s = SHAPES["qwen2-0.5b"]
    cfg = Qwen2Config(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    assert abs(count_parameters(model) / 1e6 - 494.0) < 1.0  # Qwen2-0.5B: 494 M with tied embeddings


def test_bench_trainer_workload_times_unpacked_packed_and_tree_side_by_side(tiny_model):
    proc = _bench("--workload", "quickstart", "--model", tiny_model, "--trajectories", "20", "--steps", "1", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    out = result["quickstart"]
    assert result["model"] == tiny_model and out["trajectories_per_step"] == 16  # two whole groups of 8
    for layout in ("unpacked", "packed", "tree"):
        assert out[layout]["tokens_per_s"] > 0 and out[layout]["peak_rss_mb"] > 0, layout
    # every layout trains the same tokens; the tree computes each group's prompt once
    assert out["unpacked"]["computed_tokens_per_step"] == out["packed"]["computed_tokens_per_step"]
    assert out["tree"]["computed_tokens_per_step"] < out["packed"]["computed_tokens_per_step"] / 5
    assert out["tree_flop_reduction"] > 5


def test_the_workloads_share_what_they_say():
    from launch.bench.trainer_workloads import agent_batch, grpo_batch, work

    grpo = grpo_batch(0, 250)
    assert len(grpo.sequences) == 32 and grpo.num_tokens == 32 * 1280
    assert work(grpo, "tree", 1, 1, 1)["tokens"] == 2 * (1024 + 16 * 256)
    agent = agent_batch(0, 250)  # a 256-token task and 4 turns of 192; forks at turns 2 and 3
    assert len(agent.sequences) == 32 and agent.num_tokens == 32 * 1024
    assert work(agent, "tree", 1, 1, 1)["tokens"] == 8 * (256 + 192 * (1 + 2 + 4 + 4))
    flat = work(agent, "packed", 1, 1, 1)
    assert flat["flops"] == 6 * flat["tokens"] + 12 * 32 * (1024 * 1025 // 2)  # each token sees its past


def test_bench_trainer_refuses_an_unknown_workload_and_options_it_would_ignore():
    res = _refused("--workload", "chess")
    assert res.exit_code == 2 and "--workload: one of" in res.stderr
    res = _refused("--workload", "grpo", "--mixed-precision")
    assert res.exit_code == 2 and "not with --mixed-precision" in res.stderr
    res = _refused("--workload", "grpo", "--trajectories", "8")
    assert res.exit_code == 2 and "--trajectories: grpo trains groups of 16, got 8" in res.stderr
