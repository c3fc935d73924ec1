"""Configuration of the latency simulator (engine side)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout.engines.server_config import EngineServerConfig


class LengthModel(BaseModel):
    """Response lengths: a lognormal fixed by its median and p99, capped (RL rollouts' long tail)."""

    model_config = ConfigDict(extra="forbid")

    median: float = Field(1000, gt=0, description="Median response length in tokens.")
    p99: float = Field(14000, gt=0, description="99th percentile of the response length in tokens.")
    cap: int = Field(16384, ge=1, description="Longest response (the request's max_new_tokens also caps it).")
    prompt_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of the log-length's variance that comes from the prompt (0: every response drawn on "
        "its own). Above 0, a prompt with one long answer tends to have others: hard prompts make long answers, "
        "the property tail batching (RollPacker) relies on when it reruns long-tail prompts together.",
    )


class SimEngineConfig(EngineServerConfig):
    """An engine server whose decode time is a function of batch size, response lengths,
    weight-load time and time scale (``engine: {type: sim}``).

    Defaults sketch a 7B model on one H100: a decode step of 12 ms plus 0.12 ms per running
    sequence, so throughput grows with the batch until ``max_running_requests``.
    """

    type: Literal["sim"] = Field("sim", description="Serve the latency simulator instead of a model.")
    model_path: str | None = Field(None, description="Tokenizer directory reported as the model; default: the run's.")
    max_running_requests: int = Field(64, ge=1, description="Requests decoded together; the rest wait in the queue.")

    time_scale: float = Field(100.0, gt=0, description="Simulated seconds per wall-clock second.")
    decode_base_ms: float = Field(12.0, ge=0, description="Simulated time of one decode step, fixed part.")
    decode_per_seq_ms: float = Field(0.12, ge=0, description="Simulated time of one decode step per sequence.")
    weight_load_s: float = Field(2.0, ge=0, description="Simulated time to load new weights.")
    lengths: LengthModel = Field(default_factory=LengthModel, description="Response length distribution.")
    token_id: int = Field(120, ge=0, description="The token every simulated response is made of.")
    seed: int = Field(0, description="Seed of the length draws (a request's length depends on it and its id).")

    def step_s(self, batch: int) -> float:
        """Simulated seconds of one decode step with ``batch`` running sequences."""
        return (self.decode_base_ms + self.decode_per_seq_ms * batch) / 1000.0
