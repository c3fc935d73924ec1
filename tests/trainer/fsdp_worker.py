"""Run under torchrun: train on this rank's whole groups with FSDP2 and report loss and weights.

Usage: torchrun --nproc_per_node 2 tests/trainer/fsdp_worker.py MODEL_DIR OUT_FILE STEPS [CONFIG_JSON]
(CONFIG_JSON: more TrainerConfig fields, e.g. '{"mixed_precision": {}}'; with routing replay every
trajectory gets made-up routing, ``helpers.random_routing``).
"""

import json
import sys

import torch
import torch.distributed as dist

from sample_buffer.routing import moe_shape
from tests.trainer.helpers import random_routing, toy_batch
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.config import TrainerConfig
from trainer.durable import latest_checkpoint
from trainer.engine import TrainEngine
from trainer.export import full_state_dict


def main() -> None:
    model, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = TrainerConfig(model_path=model, lr=1e-3, micro_batch_tokens=48, mini_batches=2, **extra)
    engine = TrainEngine(config)
    losses = []
    for step in range(steps):
        batch = toy_batch(seed=step)
        if config.moe.routing == "replay":
            batch = random_routing(batch, moe_shape(engine.model), seed=step)
        groups = batch.group_ids.tolist()
        mine = [i for i, g in enumerate(groups) if g % world == rank]  # whole groups per rank
        losses.append(engine.train_step(batch.select(mine))["loss"])
    state = full_state_dict(engine.model)
    ckpt = save_checkpoint(engine, out + ".ckpt")
    again = TrainEngine(config)
    load_checkpoint(again, latest_checkpoint(out + ".ckpt"))
    reloaded = full_state_dict(again.model)
    if rank == 0:
        same = all(torch.equal(reloaded[k], v) for k, v in state.items())
        master = {p.to_local().dtype if hasattr(p, "to_local") else p.dtype for p in engine.model.parameters()}
        torch.save(
            {
                "losses": losses,
                "state": state,
                "world": world,
                "ckpt": str(ckpt),
                "reload_equal": same,
                "master_dtypes": sorted(str(d) for d in master),
            },
            out,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
