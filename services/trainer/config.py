"""Configuration of the trainer process: the training loop's config plus what the process adds."""

from __future__ import annotations

from pydantic import Field

from services.trackers.config import TrackingConfig
from services.weight_transports import PublisherConfig
from services.weight_transports.disk import DiskPublisherConfig
from trainer.config import TrainLoopConfig


class TrainerProcessConfig(TrainLoopConfig):
    """The trainer process around the training loop (``train_loop`` in a run config)."""

    publisher: PublisherConfig = Field(
        default_factory=DiskPublisherConfig,
        description="Weight transport to the engines, by `type`: disk (default), http_buckets, ipc (engines on this "
        "machine; CUDA IPC on a GPU) or collective (NCCL / gloo broadcast).",
    )
    colocated_lease_s: float = Field(
        900.0,
        gt=0,
        description="devices.placement colocated: how long the engines may stay released while a step "
        "trains; past it the LLMProxy takes their memory back and resumes generation (a trainer that died).",
    )
    metrics_host: str = Field("127.0.0.1", description="Address the Prometheus /metrics endpoint binds.")
    metrics_port: int = Field(9105, ge=0, le=65535, description="Prometheus /metrics port; 0 disables it.")
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="Also log metrics to TensorBoard / Weights & Biases."
    )
