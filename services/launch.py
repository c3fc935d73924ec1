"""Start service processes on loopback and wait until they answer (demo, benchmarks, tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers 200; raise with the process's output if it dies first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise RuntimeError(f"process exited with code {proc.returncode} before {url} was healthy:\n{out[-3000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f}s")


def start_engine_process(
    model_path: str, port: int | None = None, extra: list[str] | None = None, timeout_s: float = 120.0
) -> tuple[subprocess.Popen, str]:
    """Run ``rollmesh serve engine`` as its own process; returns (process, base URL) once healthy."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "services.cli", "serve", "engine"]
    cmd += ["--set", f"engine.model_path={model_path}", "--set", f"engine.port={port}"]
    for o in extra or []:
        cmd += ["--set", o]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_healthy(url + "/health", timeout_s, proc)
    except BaseException:
        stop_process(proc)
        raise
    return proc, url


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it does not exit in time."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
