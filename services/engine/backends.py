"""Engine backends: what rollmesh knows about each kind of engine, behind one registry.

``engine.type`` in a run config picks a backend. Everything that depends on the kind of engine (the
config's variants, the HTTP API the LLMProxy speaks to it, how its server process runs, which weight
transports it receives, whether it can give its GPU memory back, whether rollmesh sets its torch
threads) asks the backend here instead of comparing names.

Adding a backend: a package ``rollout/engines/<name>/`` with its config (a subclass of
``EngineServerConfig`` with ``type: Literal["<name>"]``) and, if it speaks a new HTTP API, its client
(a subclass of ``HTTPEngineClient``, added to ``ENGINE_APIS``); how its server runs (a
``serve(config, auth)`` function, usually ``services/engine/<name>_server.py``); one entry in
``BACKENDS``; tests.

This module imports no model library: the config loader and the light services read it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

from rollout.engines.embedded.config import EngineConfig
from rollout.engines.http_engine import HTTPEngineClient
from rollout.engines.server_config import EngineServerConfig
from rollout.engines.sglang.client import SGLangClient
from rollout.engines.sglang.config import SGLangEngineConfig
from rollout.engines.sim.config import SimEngineConfig
from rollout.engines.vllm.client import VLLMClient
from rollout.engines.vllm.config import VLLMEngineConfig
from sample_buffer.registry import tagged_union

EngineApi = Literal["sglang", "vllm"]

# The engine HTTP APIs the LLMProxy speaks (``proxy.engine_api``), each with its client.
ENGINE_APIS: dict[str, type[HTTPEngineClient]] = {"sglang": SGLangClient, "vllm": VLLMClient}

ALL_TRANSPORTS = frozenset({"disk", "http_buckets", "ipc", "collective"})  # train_loop.publisher.type


@dataclass(frozen=True)
class Backend:
    config: type[EngineServerConfig]
    api: EngineApi  # the HTTP API its server speaks
    # "module:function" that runs its server until SIGTERM, ``serve(config, auth)``: imported only
    # when the server starts, so that reading a config loads no model library.
    serve: str
    # In-process engines (served by services/engine/server.py): "module:Class" built from the config.
    engine: str | None = None
    transports: frozenset[str] = ALL_TRANSPORTS  # the weight transports it receives
    applies_deltas: bool = False  # http_buckets with delta: true (rollout/engines/weight_delta.py)
    # LoRA adapters per request (SGLang's /load_lora_adapter and lora_path) as rollmesh starts it with
    # engine.max_loaded_loras: what `rollmesh serve tinker` samples with (SGLang has them with
    # --enable-lora, not wired into its launch yet)
    serves_adapters: bool = False
    adapts_lm_head: bool = True  # its adapters may adapt the output layer (vLLM serves no LoRA on lm_head)
    releases_memory: bool = True  # gives GPU memory back while a colocated trainer trains
    uses_gpu: bool = True
    loads_model: bool = True  # its model_path is a model's directory (the simulator's: a tokenizer's at most)
    torch_threads: bool = False  # a torch process in rollmesh's hands: `rollmesh run` sets its num_threads
    colocated_settings: tuple[tuple[str, object], ...] = ()  # engine.<key> = value when colocated
    # MoE routing replay: whether its answers can carry each position's experts, and engine.<key> = value
    # that makes them (None: it cannot)
    routing_settings: tuple[tuple[str, object], ...] | None = ()
    # Samples n of one prompt in one request, its prefill shared (SGLang's sampling_params.n): a group's
    # samples travel as one request (env_manager.replicate_prompts false). vLLM's client sends n
    # requests, whose prefill vLLM's prefix cache shares.
    samples_n: bool = True
    # How the ``ipc`` transport writes tensor handles for it (rollout/engines/tensor_handles.py):
    # rollmesh's own format, read by code, or SGLang's pickled one, which SGLang reads itself.
    handle_encoding: Literal["rollmesh", "sglang"] = "rollmesh"

    def serve_fn(self):
        return _attribute(self.serve)

    def build(self, config: EngineServerConfig):
        """The in-process engine of an embedded-style backend, not started."""
        if self.engine is None:
            raise ValueError(f"engine.type: {config.type!r} runs its own server; it has no in-process engine")
        return _attribute(self.engine)(config)


def _attribute(path: str):
    """``"module:name"`` (a path written in this file, never one a caller gives), imported."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


_IN_PROCESS = "services.engine.server:serve"

BACKENDS: dict[str, Backend] = {
    "embedded": Backend(
        EngineConfig,
        "sglang",
        _IN_PROCESS,
        "rollout.engines.embedded.engine:EmbeddedEngine",
        torch_threads=True,
        applies_deltas=True,
        serves_adapters=True,
    ),
    # vLLM loads new weights from disk or over a group; it keeps its memory (no sleep mode wired).
    "vllm": Backend(
        VLLMEngineConfig,
        "vllm",
        "services.engine.vllm_server:serve",
        serves_adapters=True,
        adapts_lm_head=False,
        transports=frozenset({"disk", "collective"}),
        releases_memory=False,
        samples_n=False,
        routing_settings=(("enable_return_routed_experts", True),),  # a GPU build only (vllm_server.py)
    ),
    # SGLang frees GPU memory only with its memory saver.
    "sglang": Backend(
        SGLangEngineConfig,
        "sglang",
        "services.engine.sglang_server:serve",
        colocated_settings=(("enable_memory_saver", True),),
        routing_settings=(("enable_return_routed_experts", True),),
        handle_encoding="sglang",
    ),
    "sim": Backend(
        SimEngineConfig,
        "sglang",
        _IN_PROCESS,
        "rollout.engines.sim.engine:SimEngine",
        uses_gpu=False,
        loads_model=False,
        routing_settings=None,
    ),
}

# What `engine:` in a run config may be: one of the backends' configs, by `type` (default: embedded).
EngineVariant = tagged_union(*(b.config for b in BACKENDS.values()), default="embedded")


def backend(config: EngineServerConfig) -> Backend:
    return BACKENDS[config.type]
