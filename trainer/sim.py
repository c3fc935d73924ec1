"""The simulated trainer: the TrainEngine's interface, with time proportional to tokens.

``rollmesh bench async`` runs the real trainer loop (get → train → ack → publish through the
controller) on top of this, so only the optimizer step itself is modelled. Publishing writes a
small marker directory that the simulated engines accept.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class SimTrainerConfig(BaseModel):
    """Training time = tokens / train_tokens_per_s simulated seconds, compressed by ``time_scale``.

    The default throughput sketches a training pool the size of the simulated inference pool (two
    H100s beside the two engines) on the engines' 7B model: forward + backward + the proximal
    log-prob pass of decoupled PPO is ~8N = 56 GFLOP a token, and two H100s at ~25% MFU (usual for
    RL's long, ragged sequences) give ~9,000 tokens/s. A step's training then takes ~0.7 of its
    generation at full engines: the balanced pools where asynchrony pays (ROLL Flash).
    """

    model_config = ConfigDict(extra="forbid")

    type: Literal["sim"] = Field("sim", description="Simulate training time instead of training a model.")
    time_scale: float = Field(100.0, gt=0, description="Simulated seconds per wall second (match the engines').")
    train_tokens_per_s: float = Field(
        9000.0, gt=0, description="Simulated training throughput over all tokens (prompt + response)."
    )
    step_overhead_s: float = Field(1.0, ge=0, description="Fixed simulated time per step (optimizer, sync).")


class SimTrainEngine:
    """Stands in for ``trainer.engine.TrainEngine`` in the trainer loop."""

    def __init__(self, config: SimTrainerConfig) -> None:
        self.config = config
        self.step = 0
        self.version = 0
        self.simulated_s = 0.0  # total simulated training time

    def train_step(self, batch) -> dict[str, float]:
        tokens = sum(len(s) for s in batch.sequences)
        seconds = self.config.step_overhead_s + tokens / self.config.train_tokens_per_s
        time.sleep(seconds / self.config.time_scale)
        self.simulated_s += seconds
        self.step += 1
        self.version += 1
        rewards = batch.rewards
        return {
            "loss": 0.0,
            "tokens": float(batch.loss_mask.sum()),
            "train_tokens": float(tokens),
            "sim_train_s": seconds,
            "reward_mean": float(rewards.mean()) if len(rewards) else 0.0,
        }

    def export(self, out_dir: str | Path, state: dict | None = None) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({"simulated": True, "version": self.version}))
        return out
