"""What every engine server's config has: the model it serves and where it listens."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EngineServerConfig(BaseModel):
    """Base of the ``engine:`` variants (embedded, vllm, sim); each adds its ``type`` and its own knobs."""

    model_config = ConfigDict(extra="forbid")

    model_path: str | None = Field(
        None, description="Local Hugging Face model directory to serve; default: the run's model_path."
    )
    load_roots: list[str] = Field(
        default_factory=list,
        description="Directories /update_weights_from_disk may load from (and anything below them); the served "
        "model's own directory always. Empty: the run's exported weights (train_loop.run_dir/weights).",
    )
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(30000, ge=0, le=65535, description="HTTP port (SGLang's default is 30000).")
