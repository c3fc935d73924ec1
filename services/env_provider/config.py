"""Configuration of an environment provider: which environment it hosts and where it serves."""

from __future__ import annotations

from pydantic import Field, model_validator

from rollout.config import TaskConfig


class EnvProviderConfig(TaskConfig):
    """A process that hosts a rollmesh environment for remote EnvManagers, over gRPC (rollmesh's
    ``EnvProvider``) and HTTP (OpenEnv's REST routes and WebSocket sessions) at once."""

    host: str = Field("127.0.0.1", description="Address both servers bind.")
    grpc_port: int = Field(50060, ge=0, le=65535, description="gRPC port (0: pick a free one).")
    http_port: int = Field(8060, ge=0, le=65535, description="HTTP port: /reset, /step, /ws, /health, /metrics.")
    max_sessions: int = Field(256, ge=1, description="Episodes hosted at once; a reset beyond is refused (busy).")
    step_timeout_s: float = Field(
        60.0, gt=0, description="Longest reset or step of the environment (a caller's shorter timeout_s wins)."
    )
    session_idle_s: float = Field(
        600.0, gt=0, description="An episode nobody stepped for this long is closed (its caller died)."
    )
    ws_ping_interval_s: float = Field(
        20.0,
        gt=0,
        description="WebSocket keepalive: a ping this often, and a client that has not answered one "
        "within as long again is disconnected (uvicorn's defaults).",
    )
    max_action_chars: int = Field(65_536, ge=1, description="A longer action is refused (INVALID_ARGUMENT / 400).")
    token_env: str = Field(
        "ROLLMESH_PROVIDER_TOKEN",
        description="Environment variable with the token callers must send: the provider's own, never the "
        "mesh's (which this process holds only to score at the mesh's reward service).",
    )

    @model_validator(mode="after")
    def _hosts_a_local_env(self) -> EnvProviderConfig:
        if self.env.type == "remote":
            raise ValueError("env.type: a provider hosts an environment of its own, not another provider's")
        if self.teacher is not None:  # the EnvManager that runs the episodes has its groups taught
            raise ValueError("teacher: a provider plays episodes; the EnvManager's task names the teacher")
        return self
