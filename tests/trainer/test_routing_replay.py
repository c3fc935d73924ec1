"""Routing replay (R3) in the trainer: the recorded experts are the ones used, exactly.

On the tiny Qwen3-MoE: replaying the routing a forward of the same weights chose reproduces the free
forward, packed and unpacked; other routing changes the numbers while the router still gets its
gradient, and the reference model replays it too; activation checkpointing's recomputation replays
the same experts; a trajectory whose routing is missing, partial or
not this model's is not trained on and is counted; replay on a dense model is refused at start.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout.engines.embedded.routing import RoutingCapture
from sample_buffer.routing import moe_shape
from tests.trainer.helpers import random_routing, toy_batch
from trainer.config import TrainerConfig
from trainer.engine import TrainEngine

REPLAY = {"routing": "replay"}


def _own_routing(model_path: str, batch) -> list[np.ndarray]:
    """Each sequence's routing as a forward of these weights picks it (every position but the last)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path).eval()
    capture = RoutingCapture(hf)
    out = []
    with torch.no_grad():
        for seq in batch.sequences:
            hf(input_ids=seq[None, :-1])
            out.append(capture.take(1, len(seq) - 1)[0])
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replaying_the_routing_the_weights_chose_reproduces_the_free_forward(tiny_moe, packed):
    batch = toy_batch(seed=3)
    batch.routed_experts = _own_routing(tiny_moe, batch)
    config = dict(model_path=tiny_moe, pack_sequences=packed, micro_batch_tokens=64)
    free = TrainEngine(TrainerConfig(**config)).logprobs(batch)
    replayed = TrainEngine(TrainerConfig(**config, moe=REPLAY)).logprobs(batch)
    assert (free - replayed).abs().max().item() <= 1e-6
    assert free.abs().sum() > 0


def test_other_routing_is_what_the_forward_uses_and_the_router_still_learns(tiny_moe):
    engine = TrainEngine(TrainerConfig(model_path=tiny_moe, ref_model_path=tiny_moe, lr=1e-2, moe=REPLAY))
    batch = random_routing(toy_batch(seed=4), engine.replay[id(engine.model)].shape, seed=1)
    replayed = engine.logprobs(batch)
    free = engine.logprobs(toy_batch(seed=4))  # no routing recorded: the routers choose
    assert (replayed - free).abs().max().item() > 1e-2
    # the reference model replays the same experts: equal weights, equal numbers
    assert (engine.logprobs(batch, engine.ref) - replayed).abs().max().item() <= 1e-6
    routers = {n: p.detach().clone() for n, p in engine.model.named_parameters() if n.endswith("mlp.gate.weight")}
    assert len(routers) == 4
    stats = engine.train_step(batch)
    assert stats["routing_dropped"] == 0
    moved = {n: (p - routers[n]).abs().max().item() for n, p in engine.model.named_parameters() if n in routers}
    assert all(v > 0 for v in moved.values()), moved  # the gates are the router's: it gets a gradient


def test_activation_checkpointing_recomputes_each_layer_with_the_replayed_experts(tiny_moe):
    """The backward recomputes every layer after the forward returned: it must replay the same ids."""
    steps = []
    for checkpointing in (False, True):
        engine = TrainEngine(TrainerConfig(model_path=tiny_moe, moe=REPLAY, activation_checkpointing=checkpointing))
        steps.append(engine.train_step(random_routing(toy_batch(seed=6), moe_shape(engine.model), seed=2)))
    free = TrainEngine(TrainerConfig(model_path=tiny_moe)).train_step(toy_batch(seed=6))
    # the gradient's norm (before the step) is the same: the recomputation replayed the same experts
    assert abs(steps[0]["grad_norm"] - steps[1]["grad_norm"]) <= 1e-5 * steps[0]["grad_norm"]
    assert abs(steps[0]["loss"] - steps[1]["loss"]) <= 1e-6
    assert abs(free["grad_norm"] - steps[0]["grad_norm"]) > 1e-3 * steps[0]["grad_norm"]  # it can tell


def test_a_trajectory_without_complete_routing_for_this_model_is_not_trained_on(tiny_moe):
    engine = TrainEngine(TrainerConfig(model_path=tiny_moe, moe=REPLAY))
    shape = moe_shape(engine.model)
    batch = random_routing(toy_batch(seed=5), shape)
    tokens = float(batch.loss_mask.sum())
    bad = {
        1: None,  # never recorded
        2: batch.routed_experts[2][:-1],  # a position short
        5: np.full_like(batch.routed_experts[5], shape.num_experts),  # expert ids past the model's 8
        6: batch.routed_experts[6][:, : shape.top_k],  # one layer's ids: another model's layout
    }
    lost = sum(float(batch.loss_mask[i].sum()) for i in bad)
    for i, r in bad.items():
        batch.routed_experts[i] = r
    stats = engine.train_step(batch)
    assert stats["routing_dropped"] == 4
    assert stats["tokens"] == tokens - lost  # trained on every other trajectory's tokens


def test_replay_on_a_dense_model_is_refused_at_start(tiny_model):
    with pytest.raises(ValueError, match="trainer.moe.routing: replay needs a mixture-of-experts model"):
        TrainEngine(TrainerConfig(model_path=tiny_model, moe=REPLAY))
