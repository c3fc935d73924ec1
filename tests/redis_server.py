"""A real redis-server on a free loopback port, with AOF, that tests can kill -9 and restart."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from services.launch import free_port


class RedisServer:
    def __init__(self, data_dir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: `make test` installs it (apt-get install redis-server)")
        self.binary, self.dir, self.port = binary, data_dir, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        args += ["--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return self
            except redis.RedisError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {self.port} did not answer within 20s")

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill9()
