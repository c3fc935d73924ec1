"""FSDP2 on CPU: two gloo ranks under torchrun train exactly like one process on the whole batch,
mini-batches included; in bfloat16 mixed precision (float32 master weights and reductions) they
train as close to it as bfloat16 allows; activation checkpointing changes no number."""

import json
import os
import subprocess
import sys

import pytest
import torch

from sample_buffer.routing import moe_shape
from tests.trainer.helpers import random_routing, toy_batch
from trainer.config import TrainerConfig
from trainer.engine import TrainEngine
from trainer.export import full_state_dict

STEPS = 2


def _two_ranks(tiny_model, out, extra: str = "{}") -> dict:
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "tests/trainer/fsdp_worker.py",
        tiny_model,
        str(out),
        str(STEPS),
        extra,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


def _single(tiny_model, **extra) -> tuple[list[float], dict]:
    single = TrainEngine(TrainerConfig(model_path=tiny_model, lr=1e-3, micro_batch_tokens=48, mini_batches=2, **extra))
    on = any(getattr(m, "gradient_checkpointing", False) for m in single.model.modules())  # any transformers
    assert on == bool(extra.get("activation_checkpointing"))
    batches = [toy_batch(seed=s) for s in range(STEPS)]
    if single.replay:  # as the worker: made-up routing, the same on both sides
        batches = [random_routing(b, moe_shape(single.model), seed=s) for s, b in enumerate(batches)]
    losses = [single.train_step(b)["loss"] for b in batches]
    return losses, full_state_dict(single.model)


def test_two_rank_fsdp2_matches_single_process(tiny_model, tmp_path):
    """The ranks pack their groups as prefix trees (each prompt once); the single process pads."""
    sharded = _two_ranks(tiny_model, tmp_path / "fsdp.pt", json.dumps({"pack_sequences": True, "tree_packing": True}))
    assert sharded["world"] == 2 and sharded["reload_equal"], "checkpoint round trip under FSDP2 changed weights"

    # Two mini-batches per step: rank r holds groups r, r + 2, so slice i is groups 2i and 2i + 1 on
    # both sides, and each of the two optimizer steps sees the same groups.
    losses, state = _single(tiny_model)
    for a, b in zip(sharded["losses"], losses):
        assert abs(a - b) <= 1e-5, (sharded["losses"], losses)
    for k, v in state.items():
        assert (sharded["state"][k] - v).abs().max().item() <= 1e-4, k  # a tenth of one Adam step


def test_two_rank_fsdp2_replays_routing_like_one_process(tiny_moe, tmp_path):
    """An MoE with routing replay: two ranks, each laying out only its own groups' experts, train as
    one process does on the whole batch."""
    extra = {"moe": {"routing": "replay"}}
    sharded = _two_ranks(tiny_moe, tmp_path / "moe.pt", json.dumps(extra))
    assert sharded["world"] == 2 and sharded["reload_equal"]
    losses, state = _single(tiny_moe, **extra)
    for a, b in zip(sharded["losses"], losses):
        assert abs(a - b) <= 1e-5, (sharded["losses"], losses)
    for k, v in state.items():
        assert (sharded["state"][k] - v).abs().max().item() <= 1e-4, k


def test_bfloat16_mixed_precision_trains_close_to_float32_with_float32_master_weights(tiny_model, tmp_path):
    sharded = _two_ranks(tiny_model, tmp_path / "mp.pt", '{"mixed_precision": {}}')
    assert sharded["world"] == 2 and sharded["reload_equal"]
    assert sharded["master_dtypes"] == ["torch.float32"]  # the optimizer updates float32 weights
    fp32_losses, fp32_state = _single(tiny_model)
    auto_losses, auto_state = _single(tiny_model, mixed_precision={})  # one process: torch.autocast
    for mp in (sharded["losses"], auto_losses):
        for a, b in zip(mp, fp32_losses):
            assert a != b and abs(a - b) <= 2e-2, (mp, fp32_losses)  # bfloat16's rounding, no more
    start = full_state_dict(TrainEngine(TrainerConfig(model_path=tiny_model)).model)
    assert any((sharded["state"][k] != start[k]).any() for k in start)  # it trained
    for k, v in fp32_state.items():
        assert sharded["state"][k].dtype == torch.float32
        # Adam moves each weight by about lr per optimizer step whatever the gradient's size:
        # bfloat16 may flip a near-zero gradient's sign, so a weight may differ by 2 lr per step.
        optimizer_steps = STEPS * 2  # mini_batches=2
        assert (sharded["state"][k] - v).abs().max().item() <= 2 * optimizer_steps * 1e-3, k


@pytest.mark.parametrize("layout", [{}, {"pack_sequences": True, "tree_packing": True}])
def test_activation_checkpointing_changes_no_number(tiny_model, layout):
    """Recomputed layers attend as the first forward did (packed: the plan travels with the call)."""
    plain_losses, plain = _single(tiny_model, **layout)
    ckpt_losses, ckpt = _single(tiny_model, activation_checkpointing=True, **layout)
    assert ckpt_losses == pytest.approx(plain_losses, abs=1e-6)
    for k, v in plain.items():
        assert (ckpt[k] - v).abs().max().item() <= 1e-6, k
