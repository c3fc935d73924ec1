"""Token-in/token-out with images: a trajectory the embedded engine sampled from a vision-language
prompt, through the codec into the trainer, gives back the engine's log-probs within 1e-4 (float32),
packed or not, several images per prompt, text-only rows beside, images shared by a group's replicas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.engine import EmbeddedEngine
from rollout.sampling import SamplingParams
from sample_buffer.codec import decode_group, encode_group
from sample_buffer.trajectory import Group, Trajectory
from sample_buffer.vision import Vision, content_hash, image_bytes
from tests.rollout.test_engine_vision import png
from trainer.batch import batch_from_groups
from trainer.config import TrainerConfig
from trainer.engine import TrainEngine
from trainer.tiny_model import TinyModelConfig, build_tiny_model
from trainer.vision_inputs import split_vision_parameters


@pytest.fixture(scope="module", params=["qwen2-vl", "llava"])
def sampled(request, tmp_path_factory):
    """Groups of 3 sampled answers to image prompts (two images, one, none), as the rollout records them."""
    path = str(
        build_tiny_model(
            tmp_path_factory.mktemp(request.param),
            TinyModelConfig(arch=request.param, hidden_size=64, num_hidden_layers=2),
        )
    )
    engine = EmbeddedEngine(EngineConfig(model_path=path, max_running_requests=4)).start()
    vision = Vision(path, engine.hf_config)
    pad = vision.image_token_id
    cases = [
        ([1, 40, pad, 41, pad, 42], [png(28, 28, 1), png(40, 24, 2)]),
        ([1, pad, 50, 51], [png(32, 32, 3)]),
        ([1, 60, 61], []),
    ]
    groups = []
    try:
        for g, (prompt, images) in enumerate(cases):
            expanded = vision.prompt(prompt, images).input_ids if images else prompt  # what the rollout records
            raw = [image_bytes(x) for x in images]
            trajs = []
            for k in range(3):
                params = SamplingParams(
                    max_new_tokens=6 + 3 * k, temperature=0.9, ignore_eos=True, sampling_seed=10 * g + k
                )
                out = engine.submit(f"{g}-{k}", prompt, params, image_data=images).result(120)
                assert out.prompt_tokens == len(expanded)  # the engine consumed the ids the rollout records
                n = len(out.output_ids)
                trajs.append(
                    Trajectory(
                        trajectory_id=f"{g}-{k}",
                        group_id=f"g{g}",
                        prompt_id=f"p{g}",
                        token_ids=expanded + out.output_ids,
                        loss_mask=[0] * len(expanded) + [1] * n,
                        behavior_logprobs=out.behavior_logprobs,
                        token_versions=[0] * n,
                        reward=float(k),
                        start_version=0,
                        images=tuple(content_hash(r) for r in raw),
                        metadata={"turn_starts": [len(expanded)], "turn_temperatures": [0.9]},
                    )
                )
            groups.append(
                decode_group(encode_group(Group(f"g{g}", f"p{g}", trajs, images={content_hash(r): r for r in raw})))
            )
    finally:
        engine.shutdown()
    yield path, groups


@pytest.mark.parametrize("packed", [True, False])
def test_the_trainer_reproduces_the_engines_logprobs_on_image_prompts(sampled, packed):
    path, groups = sampled
    batch = batch_from_groups(groups)
    assert batch.images is not None and [len(x) for x in batch.images] == [2, 2, 2, 1, 1, 1, 0, 0, 0]
    trainer = TrainEngine(TrainerConfig(model_path=path, pack_sequences=packed, micro_batch_tokens=200))
    lp = trainer.logprobs(batch)
    mask = batch.loss_mask.bool()
    gap = (lp[mask] - batch.behavior_logprobs[mask]).abs().max().item()
    assert gap <= 1e-4, gap
    # without its images the forward is another one: the check above could fail
    batch.images = None
    blind = trainer.logprobs(batch)
    assert (blind[mask] - batch.behavior_logprobs[mask]).abs().max().item() > 1e-3


def test_a_training_step_on_image_prompts_moves_the_vision_tower(sampled):
    path, groups = sampled
    trainer = TrainEngine(TrainerConfig(model_path=path, lr=1e-2))
    tower = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if "visual" in k or "vision_tower" in k}
    assert tower
    metrics = trainer.train_step(batch_from_groups(groups))
    assert np.isfinite(metrics["loss"])
    moved = [k for k, v in trainer.model.named_parameters() if k in tower and not torch.equal(v, tower[k])]
    assert moved, "the images' gradient reached no vision parameter"


def test_the_vision_tower_may_learn_at_its_own_rate(sampled, tiny_model):
    path, groups = sampled
    trainer = TrainEngine(TrainerConfig(model_path=path, lr=1e-4, vision_lr=1e-2))
    tower, language = split_vision_parameters(trainer.model)
    before = {id(p): p.detach().clone() for p in tower + language}
    trainer.train_step(batch_from_groups(groups))

    def largest_step(params):  # Adam's first step moves each weight by about its rate
        return max((p.detach() - before[id(p)]).abs().max().item() for p in params)

    assert largest_step(tower) > 20 * largest_step(language) > 0
    assert {g["lr"] for g in trainer.optimizer.param_groups} == {1e-4, 1e-2}
    with pytest.raises(ValueError, match="vision_lr: the policy has no vision tower"):
        TrainEngine(TrainerConfig(model_path=tiny_model, vision_lr=1e-2))
