"""What `trainer:` in a run config may be (by `type`), and the training engine each one builds."""

from __future__ import annotations

from collections.abc import Callable

from sample_buffer.registry import tagged_union
from trainer.config import TrainerConfig
from trainer.sim import SimTrainEngine, SimTrainerConfig


def _fsdp(config: TrainerConfig, total_steps: int | None):
    from trainer.engine import TrainEngine  # torch and the model: loaded only for a real trainer

    return TrainEngine(config, total_steps=total_steps)


# type -> (config, build(config, total_steps)); total_steps is the run's length (the LR schedule's span).
TRAINERS: dict[str, tuple[type, Callable]] = {
    "fsdp": (TrainerConfig, _fsdp),
    "sim": (SimTrainerConfig, lambda config, total_steps: SimTrainEngine(config)),
}

# FSDP2 on a real model (the default), or the simulator (`type: sim`).
TrainerVariant = tagged_union(*(config for config, _ in TRAINERS.values()), default="fsdp")


def build_trainer(config: TrainerConfig | SimTrainerConfig, total_steps: int | None = None):
    return TRAINERS[config.type][1](config, total_steps)
