"""Configuration of the AsyncController."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr


class ControllerConfig(BaseModel):
    """Policy version, admission under the async ratio, and the weight-update protocol."""

    model_config = ConfigDict(extra="forbid")

    async_ratio: int = Field(1, ge=0, description="Versions a sample may lag its training step; 0 = on-policy.")
    groups_per_step: int = Field(8, ge=1, description="Groups (prompts) the trainer consumes per optimizer step.")
    initial_model_path: str | None = Field(
        None,
        description="Weights the engines serve at version 0, restored if the first update aborts; default: the "
        "run's model_path.",
    )
    state_path: str | None = Field(
        None,
        description="JSON file keeping the version and its weights' directory across restarts (written at every "
        "commit; read at start, when the engines are brought to that version before anything is admitted). Empty "
        "string: not kept. Default: RUN_DIR/controller.json.",
    )
    update_timeout_s: float = Field(
        300.0, gt=0, description="An update not committed within this is aborted and rolled back."
    )
    suspend_mode: Literal["continue", "in_place"] = Field(
        "continue",
        description="How generation stops for a weight update. continue: in-flight requests are aborted and "
        "re-submitted with their partial tokens after resume (re-prefilled under the new weights). in_place: "
        "engines pause with their requests inside and go on after the load without a round trip through the "
        "proxy (no abort, no re-submission). What happens to their KV cache is the engine's: the embedded engine "
        "re-prefills each running request under the new weights, or keeps it (engine.kv_on_update: keep); "
        "SGLang's in-place pause keeps it.",
    )
    control_timeout_s: float = Field(30.0, gt=0, description="Timeout of each suspend/resume/restore call.")
    reconcile_s: float = Field(
        2.0,
        gt=0,
        description="How often the controller checks that the engines serve the committed version (a "
        "restarted LLMProxy finds restarted engines at their initial weights) and sends them its weights if not.",
    )
    buffer_poll_s: float = Field(
        0.1,
        gt=0,
        description="How often the controller asks the SampleBuffer how many groups it holds (admission "
        "counts them: a count the buffer keeps cannot drift or be lost in a restart).",
    )
    holder_lease_s: float = Field(
        30.0,
        gt=0,
        description="A named admitter (an EnvManager) that has not reported for this long loses its admission "
        "slots: it died and did not come back under its name. EnvManagers report at least every "
        "env_manager.heartbeat_s, so keep this several of those.",
    )
    # The run publishes a LoRA adapter the engines serve by name (train_loop.publisher: disk with
    # adapter), so restoring a version loads an adapter: set when the run config loads.
    _adapter_updates: bool = PrivateAttr(False)
    host: str = Field("127.0.0.1", description="Address the gRPC server binds.")
    port: int = Field(50053, ge=0, le=65535, description="gRPC port.")
    metrics_port: int = Field(9103, ge=0, le=65535, description="Prometheus /metrics port; 0 disables it.")
