"""The mesh's addresses: where each service is reached, read by every client of it (the launcher
fills them in; a cluster names its Services)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MeshConfig(BaseModel):
    """Where each service of the mesh is reached: written once, read by every client.
    (``rollmesh run`` fills these in with the ports it picks; a cluster names its Services.)"""

    model_config = ConfigDict(extra="forbid")

    proxy: str = Field("127.0.0.1:50051", description="LLMProxy gRPC address (host:port).")
    buffer: str = Field("127.0.0.1:50052", description="SampleBuffer gRPC address (host:port).")
    controller: str = Field("127.0.0.1:50053", description="AsyncController gRPC address (host:port).")
    reward: str = Field(
        "127.0.0.1:50057",
        description="RewardService gRPC address (host:port): where a `reward: {type: service}` naming no address "
        "is scored.",
    )
    teachers: dict[str, str] = Field(
        default_factory=dict,
        description="On-policy distillation: each teacher's LLMProxy gRPC address (host:port) by name, as a task's "
        "teacher names it.",
    )
