"""Engine servers for tests: which URLs, which API, which processes."""

from __future__ import annotations

import tempfile

from services.processes import start_engine_process

# The tests' embedded engines load weights the tests export under their temporary directories.
TEST_LOAD_ROOTS = [f"load_roots=[{tempfile.gettempdir()}]"]


class Engines(list):
    """Base URLs of engine servers and the HTTP API they speak (``ProxyConfig.engine_api``)."""

    def __init__(self, urls, api: str = "sglang", procs=()) -> None:
        super().__init__(urls)
        self.api, self.procs = api, list(procs)


# vLLM without torch.compile: it starts in about half the time, and the tests measure behaviour,
# not speed. Two cores: the engines start one after the other. LoRA on (tests/services/test_vllm_lora.py):
# every other vLLM test then also checks that serving adapters changes nothing else.
VLLM_TEST_ENGINE = [
    "type=vllm",
    "enforce_eager=true",
    "context_length=1024",
    "max_running_requests=32",
    "max_loaded_loras=4",
    *TEST_LOAD_ROOTS,
]


def start_vllm_engines(model: str, n: int) -> Engines:
    started = [start_engine_process(model, extra=VLLM_TEST_ENGINE, timeout_s=300) for _ in range(n)]
    return Engines([u for _, u in started], "vllm", [p for p, _ in started])
