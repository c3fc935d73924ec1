"""Configuration of an EnvManager service: the rollout loop's config plus where it serves."""

from __future__ import annotations

from pydantic import Field

from rollout.config import RolloutConfig


class EnvManagerConfig(RolloutConfig):
    """A pool of workers running episodes of one task through the LLMProxy (the rollout loop), as
    a service. The addresses of the services it calls come from the run's ``mesh`` section."""

    autostart: bool = Field(True, description="Start the workers when the service starts (else wait for Start).")
    put_batch_max_groups: int = Field(
        32, ge=1, description="Groups that finish together share one Put call, at most this many."
    )
    put_batch_delay_s: float = Field(
        0.005, ge=0, description="How long a finished group may wait for others to share its Put call."
    )
    heartbeat_s: float = Field(
        5.0,
        gt=0,
        description="Report the groups in flight to the controller at least this often, even when every worker "
        "is busy with a long episode: a report renews this EnvManager's lease on its slots (controller."
        "holder_lease_s).",
    )
    host: str = Field("127.0.0.1", description="Address the gRPC server binds.")
    port: int = Field(50054, ge=0, le=65535, description="gRPC port.")
    metrics_port: int = Field(9104, ge=0, le=65535, description="Prometheus /metrics port; 0 disables it.")
