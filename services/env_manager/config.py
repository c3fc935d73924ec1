"""Configuration of an EnvManager pool."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout.episode import EpisodeConfig


class EnvManagerConfig(BaseModel):
    """A pool of workers running episodes of one task through the LLMProxy."""

    model_config = ConfigDict(extra="forbid")

    dataset_path: str = Field("examples/find_digit_train.jsonl", description="JSONL rows with 'prompt' and 'answer'.")
    env: str = Field("single_turn", description="Environment: a name in rollout.envs.ENVS or 'module:Class'.")
    env_args: dict = Field(default_factory=dict, description="Keyword arguments of the environment's constructor.")
    reward: str = Field("exact_match", description="Reward function: a name in rollout.rewards or 'module:function'.")
    tokenizer_path: str = Field("models/tiny", description="Tokenizer (HF directory) used to render prompts.")
    group_size: int = Field(8, ge=1, description="Trajectories per prompt (GRPO group); n independent requests.")
    num_workers: int = Field(8, ge=1, description="Groups (prompts) in flight at once in this pool.")
    scheduling: Literal["queue", "batch"] = Field(
        "queue",
        description="queue: each group is scored and put the moment it ends, and its worker takes the next "
        "prompt. batch (the synchronous baseline): admit a step's groups, generate all, then score all, "
        "then put all.",
    )
    replicate_prompts: bool = Field(
        True,
        description="Send a prompt's n samples as n independently routed requests; false keeps them on one "
        "engine, like a single request with n samples.",
    )
    seed: int = Field(0, description="Prompts are visited in a shuffled order drawn from this seed.")
    episode: EpisodeConfig = Field(default_factory=EpisodeConfig, description="Per-episode limits and sampling.")
    proxy_address: str = Field("127.0.0.1:50051", description="LLMProxy gRPC address.")
    buffer_address: str = Field("127.0.0.1:50052", description="SampleBuffer gRPC address.")
    controller_address: str = Field("127.0.0.1:50053", description="AsyncController gRPC address.")
    autostart: bool = Field(True, description="Start the workers when the service starts (else wait for Start).")
    admit_poll_s: float = Field(0.05, gt=0, description="Wait before asking again when admission is refused.")
    host: str = Field("127.0.0.1", description="Address the gRPC server binds.")
    port: int = Field(50054, ge=0, le=65535, description="gRPC port.")
    metrics_port: int = Field(9104, ge=0, le=65535, description="Prometheus /metrics port; 0 disables it.")
