"""FSDP2 on CPU: two gloo ranks under torchrun train exactly like one process on the whole batch,
mini-batches included."""

import os
import subprocess
import sys

import torch

from tests.trainer.helpers import toy_batch
from trainer.config import TrainerConfig
from trainer.engine import TrainEngine
from trainer.export import full_state_dict

STEPS = 2


def test_two_rank_fsdp2_matches_single_process(tiny_model, tmp_path):
    out = tmp_path / "fsdp.pt"
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "tests/trainer/fsdp_worker.py", tiny_model, str(out), str(STEPS)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sharded = torch.load(out, weights_only=False)
    assert sharded["world"] == 2 and sharded["reload_equal"], "checkpoint round trip under FSDP2 changed weights"

    # Two mini-batches per step: rank r holds groups r, r + 2, so slice i is groups 2i and 2i + 1 on
    # both sides, and each of the two optimizer steps sees the same groups.
    single = TrainEngine(TrainerConfig(model_path=tiny_model, lr=1e-3, micro_batch_tokens=48, mini_batches=2))
    losses = [single.train_step(toy_batch(seed=s))["loss"] for s in range(STEPS)]
    for a, b in zip(sharded["losses"], losses):
        assert abs(a - b) <= 1e-5, (sharded["losses"], losses)
    state = full_state_dict(single.model)
    for k, v in state.items():
        assert (sharded["state"][k] - v).abs().max().item() <= 1e-4, k  # a tenth of one Adam step
