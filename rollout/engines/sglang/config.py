"""Configuration of an SGLang engine server (``engine: {type: sglang}``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollout.engines.server_config import EngineServerConfig


class SGLangEngineConfig(EngineServerConfig):
    """An SGLang server (``python -m sglang.launch_server``) started with the flags RL needs; the
    LLMProxy drives it with ``rollout.engines.sglang.client`` like the embedded engine. SGLang is
    not a rollmesh dependency: ``python`` names an interpreter whose environment has it (the GPU
    image's)."""

    type: Literal["sglang"] = Field("sglang", description="Serve the model with SGLang (GPU).")
    python: str = Field(
        "python3",
        description="Interpreter with SGLang installed: a path (relative: from the rollmesh checkout) "
        "or a command on PATH.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Weights and activations dtype (--dtype)."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs one engine shards the model over (--tp-size); each is a rank of a weight group."
    )
    mem_fraction_static: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Share of GPU memory for weights and KV cache (--mem-fraction-static); "
        "default SGLang's. Lower it where the trainer shares the GPU.",
    )
    max_running_requests: int | None = Field(None, ge=1, description="Requests decoded together (SGLang's default).")
    context_length: int | None = Field(None, ge=16, description="Longest prompt + response; default the model's.")
    seed: int = Field(0, description="Seed of the engine's sampler (--random-seed).")
    weight_version: int = Field(
        0,
        ge=0,
        description="The weight version served at start (--weight-version): a restarted engine that "
        "loads a later checkpoint says so.",
    )
    served_model_name: str | None = Field(None, description="Name in SGLang's API; default the path.")
    enable_memory_saver: bool = Field(
        False,
        description="--enable-memory-saver: lets /release_memory_occupation free the GPU (devices.placement "
        "colocated switches it on).",
    )
    enable_return_routed_experts: bool = Field(
        False,
        description="--enable-return-routed-experts: MoE routing for replay (trainer.moe.routing: replay "
        "switches it on).",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Further sglang.launch_server flags, as given: [--chunked-prefill-size, '4096'].",
    )
