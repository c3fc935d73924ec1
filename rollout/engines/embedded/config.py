"""Configuration of the embedded engine server."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollout.engines.server_config import EngineServerConfig


class EngineConfig(EngineServerConfig):
    """One embedded engine: which model it serves, where, and how large its running batch is."""

    type: Literal["embedded"] = Field("embedded", description="The embedded torch engine (the default).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' picks cuda when available.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights and activations dtype; float32 keeps log-probs exact on CPU."
    )
    max_running_requests: int = Field(
        64, ge=1, description="Requests decoded together in one batch; the rest wait in the queue."
    )
    max_prefill_tokens: int = Field(
        4096, ge=1, description="Prompt tokens (padded) admitted into one prefill forward pass."
    )
    seed: int = Field(0, description="Seed of the engine's sampler for requests without sampling_seed.")
    num_threads: int = Field(
        0,
        ge=0,
        description="torch intra-op threads; 0: `rollmesh run` gives each torch process it starts an equal share "
        "of the cores (two with a thread per core each decoded 10x slower), torch's default elsewhere.",
    )
    kv_on_update: Literal["recompute", "keep"] = Field(
        "recompute",
        description="What a weight update does to the cache of the requests running across it (kept inside "
        "the engine by controller.suspend_mode: in_place). recompute: they are re-prefilled under the new "
        "weights. keep: as SGLang's in-place pause, they go on over the keys and values the old weights wrote "
        "(no re-prefill, which on two cores cost SmolLM2 ~10 s of each step); their later tokens are sampled "
        "from the new weights over that cache, reported with those log-probs and tagged with the new version, "
        "so the loss's importance ratios are those of the tokens as sampled.",
    )
    served_model_name: str | None = Field(None, description="Name reported by /model_info; default the path.")
    max_loaded_loras: int = Field(
        8, ge=1, le=1024, description="LoRA adapters served at once (/load_lora_adapter refuses more): their memory."
    )
