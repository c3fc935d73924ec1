"""Configuration of the LLMProxy service."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_RUN_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


class SharedRunConfig(BaseModel):
    """A training run that shares this proxy's engines (``rollout/proxy/lanes.py``): its requests
    are served with its own LoRA adapter, and its suspend and weight updates touch them only. The
    run's mesh calls this proxy with its own tokens, which is how the proxy knows the run."""

    model_config = ConfigDict(extra="forbid")

    token_env: str = Field(
        ...,
        min_length=1,
        description="The environment variable holding the run's data token (its mesh's auth.token): its "
        "generation requests.",
    )
    control_token_env: str = Field(
        ...,
        min_length=1,
        description="The environment variable holding the run's control token (its mesh's auth.control_token): "
        "its suspend, resume and adapter updates.",
    )
    adapter_root: str = Field(
        ...,
        min_length=1,
        description="The folder the run publishes its adapters in (its train_loop.run_dir's weights folder, "
        "below one of the engines' engine.load_roots): an update naming any other is refused, so that no run "
        "loads another's adapter. Links are resolved where the proxy runs.",
    )


class ProxyConfig(BaseModel):
    """One LLMProxy in front of a pool of engine servers (embedded, SGLang or vLLM)."""

    model_config = ConfigDict(extra="forbid")

    engine_urls: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:30000"], description="Base URLs of the engine servers."
    )
    engine_api: Literal["sglang", "vllm"] = Field(
        "sglang",
        description="The HTTP API the engines speak: sglang (SGLang and the embedded engine) or vllm. "
        "`rollmesh run` sets it from engine.type.",
    )
    host: str = Field("127.0.0.1", description="Address the gRPC server binds.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port.")
    metrics_port: int = Field(9101, ge=0, le=65535, description="Prometheus /metrics port; 0 disables it.")
    request_timeout_s: float = Field(
        300.0, gt=0, description="Deadline of a Generate call when the caller gives none (suspension included)."
    )
    abort_grace_s: float = Field(
        5.0, gt=0, description="After a deadline, how long to wait for the engine to return the partial output."
    )
    max_retries: int = Field(2, ge=0, description="Other engines tried when an engine fails a request.")
    health_check_interval_s: float = Field(1.0, gt=0, description="Period of the /health probe of every engine.")
    health_check_timeout_s: float = Field(2.0, gt=0, description="Timeout of one /health probe.")
    health_failures_to_remove: int = Field(
        3,
        ge=1,
        description="/health probes missed in a row before an engine leaves rotation (a busy engine can miss "
        "one); a failed request takes it out at once.",
    )
    control_timeout_s: float = Field(10.0, gt=0, description="Timeout of pause/continue/abort calls to an engine.")
    update_weights_timeout_s: float = Field(
        120.0, gt=0, description="Timeout of one engine's weight update when the caller gives none."
    )
    weight_group_hosts: list[str] = Field(
        default_factory=lambda: ["127.0.0.1", "localhost", "::1"],
        description="Where a collective weight-update group may be hosted: an InitWeightsGroup naming any other "
        "master_address is refused, so no caller can aim the engines at a host:port of its choosing. A run "
        "config adds its train_loop.publisher.master_address itself.",
    )
    runs: dict[str, SharedRunConfig] = Field(
        default_factory=dict,
        description="Other training runs served on these engines, by name (lower-case letters, digits, - and _), "
        "each with its own tokens and LoRA adapter (docs/shared-pool.md); none: the engines serve this run only.",
    )
    affinity_capacity: int = Field(
        100_000, ge=0, description="Trajectory→engine affinity entries kept (LRU); 0 disables affinity."
    )

    @field_validator("runs")
    @classmethod
    def _run_names(cls, runs: dict[str, SharedRunConfig]) -> dict[str, SharedRunConfig]:
        for name in runs:
            if not _RUN_NAME.match(name):
                raise ValueError(f"{name!r}: a run's name is 1 to 32 lower-case letters, digits, - or _")
        return runs
