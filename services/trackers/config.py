"""Which experiment trackers a run writes to (``train_loop.tracking``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TrackingConfig(BaseModel):
    """Experiment trackers the trainer also writes its metrics to."""

    model_config = ConfigDict(extra="forbid")

    tensorboard_dir: str | None = Field(None, description="Write TensorBoard event files here (needs tensorboard).")
    wandb_project: str | None = Field(None, description="Log to this Weights & Biases project (needs wandb).")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="offline writes the run under run_dir/wandb to `wandb sync` later (no network)."
    )
    swanlab_project: str | None = Field(None, description="Log to this SwanLab project (needs swanlab).")
    swanlab_mode: Literal["cloud", "offline"] = Field(
        "cloud", description="offline writes the run under run_dir/swanlog to `swanlab sync` later (no network)."
    )
