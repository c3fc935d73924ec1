"""Engine servers for tests: which URLs, which API, which processes."""

from __future__ import annotations

import subprocess
import tempfile
from contextlib import contextmanager

import httpx

from services.auth import AuthConfig, http_headers
from services.processes import start_engine_process, stop_process

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
    "executor=uni",  # the worker in vLLM's engine core, as on one GPU: ~15 s less to start here
    "context_length=1024",
    "max_running_requests=32",
    "max_loaded_loras=4",
    *TEST_LOAD_ROOTS,
]


def start_vllm_engines(model: str, n: int) -> Engines:
    started = [start_engine_process(model, extra=VLLM_TEST_ENGINE, timeout_s=300) for _ in range(n)]
    return Engines([u for _, u in started], "vllm", [p for p, _ in started])


class EnginePool:
    """Idle embedded engine processes of this test process, kept between tests: starting one costs
    about 6 s of a core (importing torch and transformers), and `make test` started over a hundred.

    A test's engine comes back here only if it is alive and a reset puts it back exactly as a fresh
    one starts: generating, no memory released, no adapters, the model's weights (the checksum a fresh
    engine of the same arguments reported) at version 0, out of the default weight-update group.
    Anything else (killed, frozen, a reset that fails or times out) is stopped, and the next test gets
    a new process. What a reset leaves: the engine's counters and metrics (a test reads them before and
    after, as on the session's engine) and its sampler's random state (a test that compares samples
    across engines sets their seed)."""

    def __init__(self, max_idle: int = 4) -> None:
        self.max_idle = max_idle  # ~0.4 GB each
        self.idle: list[tuple[tuple, subprocess.Popen, str]] = []
        self.fresh_checksum: dict[tuple, str] = {}

    def start(self, model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
        key = (model, *extra)
        for i, (k, proc, url) in enumerate(self.idle):
            if k == key:
                del self.idle[i]
                return proc, url
        proc, url = start_engine_process(model, extra=extra)
        if key not in self.fresh_checksum:
            try:
                with _client(url) as c:
                    self.fresh_checksum[key] = _info(c)["weights_checksum"]
            except BaseException:
                stop_process(proc)
                raise
        return proc, url

    @contextmanager
    def borrowed(self, model: str, extra: list[str], n: int):
        """``n`` engines' URLs for a module's tests, each given back after the last."""
        started = []
        try:
            for _ in range(n):
                started.append(self.start(model, extra))
            yield [url for _, url in started]
        finally:
            for proc, url in started:
                self.give_back(model, extra, proc, url)

    def give_back(self, model: str, extra: list[str], proc: subprocess.Popen, url: str) -> None:
        key = (model, *extra)
        if proc.poll() is None and self._reset(key, model, url):
            self.idle.append((key, proc, url))
            while len(self.idle) > self.max_idle:
                stop_process(self.idle.pop(0)[1])
        else:
            stop_process(proc)

    def close(self) -> None:
        for _, proc, _ in self.idle:
            stop_process(proc)
        self.idle.clear()

    def _reset(self, key: tuple, model: str, url: str) -> bool:
        try:
            with _client(url) as c:
                if _info(c)["memory_released"]:
                    c.post("/resume_memory_occupation").raise_for_status()
                c.post("/continue_generation").raise_for_status()
                c.post("/abort_request", json={"abort_all": True}).raise_for_status()
                # A group a collective test left (its trainer gone): 400 when there is none.
                c.post("/destroy_weights_update_group", json={"group_name": "weight_update_group"})
                for name in _info(c)["lora_adapters"]:
                    c.post("/unload_lora_adapter", json={"lora_name": name}).raise_for_status()
                body = {"model_path": model, "weight_version": "0"}
                c.post("/update_weights_from_disk", json=body).raise_for_status()
                info = _info(c)
                ok = (info["weight_version"], info["weights_checksum"], info["memory_released"], info["lora_adapters"])
                return ok == ("0", self.fresh_checksum[key], [], []) and c.get("/health_generate").status_code == 200
        except (httpx.HTTPError, KeyError, ValueError):
            return False


def _client(url: str) -> httpx.Client:
    """One client for every call of a reset (each new one builds an SSL context)."""
    return httpx.Client(base_url=url, headers=http_headers(AuthConfig()), timeout=10)


def _info(c: httpx.Client) -> dict:
    r = c.get("/get_model_info")
    r.raise_for_status()
    return r.json()
