"""Start service processes on loopback and wait until they answer (demo, benchmarks, tests)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.auth import AuthConfig, Role, ensure_provider_token, environment_of, grpc_sync_channel

DATA_ONLY = frozenset({Role.DATA})


@dataclass(frozen=True)
class Host:
    """Where a service process runs: here on loopback (``LOCAL``), or as a SLURM job step on a node of
    the allocation (``launch/slurm.py``): ``address`` is what the service binds and what the others
    dial; ``wrap`` is put before its command (``srun ... --nodelist NODE``)."""

    address: str = "127.0.0.1"
    wrap: tuple[str, ...] = ()

    def command(self, cmd: list[str], env: dict[str, str] | None = None) -> list[str]:
        """``cmd`` as this host runs it; ``env``'s variables set in the process itself (a job step's
        environment is Slurm's to set: ``CUDA_VISIBLE_DEVICES`` among others)."""
        if not self.wrap:
            return cmd
        return [*self.wrap, *(["env", *(f"{k}={v}" for k, v in env.items())] if env else []), *cmd]

    def bind(self, key: str = "host") -> list[str]:
        """The override that makes a service listen where others reach it (none here: loopback)."""
        return [] if self == LOCAL else [f"{key}={self.address}"]


LOCAL = Host()


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now, and never one this process handed out before: the kernel may give a
    port just closed again, and a service told to use two equal ports (gRPC and metrics) exited."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class StartupError(RuntimeError):
    """A service that died, or never became healthy, while starting: its name, why, the last lines it
    wrote and its log's path: what a person needs to see, instead of the launcher's own traceback."""

    def __init__(self, service: str, reason: str, log_path: Path | None, last_lines: list[str]) -> None:
        self.service, self.reason, self.log_path, self.last_lines = service, reason, log_path, last_lines
        lines = [f"{service} {reason} during start-up", *(f"  | {x}" for x in last_lines)]
        if log_path is not None:
            lines.append(f"  its log: {log_path}")
        super().__init__("\n".join(lines))


def last_lines(log_path: Path | None, since: int = 0, n: int = 8) -> list[str]:
    """The last ``n`` lines with text the log got after byte ``since`` (where this start began)."""
    if log_path is None or not log_path.exists():
        return []
    with open(log_path, "rb") as f:
        f.seek(max(since, log_path.stat().st_size - 64 * 1024))  # a traceback's end, not a whole log
        return _text_lines(f.read().decode(errors="replace"), n)


def _text_lines(text: str, n: int = 8) -> list[str]:
    return [x.rstrip() for x in text.splitlines() if x.strip()][-n:]


def _failed(service: str, e: BaseException, log_path: Path | None, lines: list[str]) -> StartupError:
    reason = f"exited with code {e.code}" if isinstance(e, _Exited) else f"was not healthy in time ({e})"
    return StartupError(service, reason, log_path, lines)


class _Exited(RuntimeError):
    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.code = code


def _exited(proc: subprocess.Popen, what: str) -> RuntimeError:
    """The error of a process that died before it served, with the end of its output when it was piped."""
    out = ""
    if proc.stdout is not None:
        try:
            os.set_blocking(proc.stdout.fileno(), False)  # a child it left may still hold the pipe open
            data = proc.stdout.read()
            out = (data.decode(errors="replace") if isinstance(data, bytes) else data or "")[-2000:]
        except (OSError, ValueError):
            pass
    message = f"process exited with code {proc.returncode} before {what}" + (f":\n{out}" if out else "")
    return _Exited(message, proc.returncode)


def wait_http_healthy(
    url: str, timeout_s: float, proc: subprocess.Popen | None = None, auth: AuthConfig | None = None
) -> None:
    """Poll ``url`` until it answers 200; raise with the process's output if it dies first."""
    deadline = time.monotonic() + timeout_s
    verify = (auth.client_ssl() if auth else None) or True
    # One client for every poll: a new one each time built an SSL context from the CA bundle, 10 times
    # a second (2 of every 5 s of a core on a slow machine, while the engine beside it was loading).
    with httpx.Client(timeout=1.0, verify=verify) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise _exited(proc, f"{url} was healthy")
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f}s")


RECONNECT_FAST = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 100),
]


def wait_grpc_healthy(
    address: str, timeout_s: float, proc: subprocess.Popen | None = None, auth: AuthConfig | None = None
) -> None:
    """Poll the gRPC health service at ``address`` until it reports SERVING (health checks need no
    token; ``auth`` matters for its TLS)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    # gRPC waits 1 s, then 1.6x longer each time, before it connects again to a server that was not
    # listening yet: a process that takes 3 s to start would be seen up to 2 s late. Poll every 0.1 s.
    with grpc_sync_channel(address, auth or AuthConfig(disabled=True), RECONNECT_FAST) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise _exited(proc, f"{address} was SERVING")
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                time.sleep(0.1)
    raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f}s")


# The run config's top-level keys (``launch/config.py``'s ``RollmeshConfig``, which a service does not
# import: tests/test_config.py keeps the two equal).
RUN_CONFIG_KEYS = frozenset(
    {"model_path", "mesh", "auth", "engine", "proxy", "buffer", "controller", "env_manager", "env_provider"}
    | {"trainer", "gateway", "tinker", "reward_service", "train_loop", "teachers", "run", "slurm", "devices"}
)


def serve_command(service: str, section: str, overrides: list[str], config_path: str | None = None) -> list[str]:
    """``rollmesh serve SERVICE [--config PATH] --set SECTION.key=value ...`` as an argv list; a
    ``key=value`` (or ``key.sub=value``) is the section's unless ``key`` is a top-level key of the run
    config (``model_path``, ``auth.disabled``)."""
    cmd = [sys.executable, "-m", "launch.cli", "serve", service]
    if config_path:
        cmd += ["--config", str(config_path)]
    for o in overrides:
        top = o.split("=", 1)[0].split(".")[0]
        cmd += ["--set", o if top in RUN_CONFIG_KEYS else f"{section}.{o}"]
    return cmd


def start_service_process(
    service: str,
    section: str,
    overrides: list[str],
    timeout_s: float = 60.0,
    config_path: str | None = None,
    log_path: Path | None = None,
    auth: AuthConfig | None = None,
    roles: frozenset[Role] = frozenset(Role),
    host: Host = LOCAL,
):
    """Run ``rollmesh serve SERVICE`` on a free port (on ``host``) with ``SECTION.key=value`` overrides,
    holding the tokens of ``roles`` only; returns (process, gRPC address) once its health check says
    SERVING."""
    port = free_port()
    cmd = host.command(serve_command(service, section, [f"port={port}", *host.bind(), *overrides], config_path))
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (lives as long as the process)
    since = out.tell() if log_path else 0
    stderr = subprocess.STDOUT if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=stderr, env=environment_of(roles))
    address = f"{host.address}:{port}"
    try:
        wait_grpc_healthy(address, timeout_s, proc, auth)
    except (_Exited, TimeoutError) as e:
        stop_process(proc)
        raise _failed(service, e, log_path, last_lines(log_path, since)) from None
    except BaseException:
        stop_process(proc)
        raise
    return proc, address


def engine_environment() -> dict[str, str]:
    return environment_of(frozenset({Role.CONTROL}))


def start_engine_process(
    model_path: str,
    port: int | None = None,
    extra: list[str] | None = None,
    timeout_s: float = 120.0,
    config_path: str | None = None,
    auth: AuthConfig | None = None,
    env: dict[str, str] | None = None,
    host: Host = LOCAL,
    log_path: Path | None = None,
) -> tuple[subprocess.Popen, str]:
    """Run ``rollmesh serve engine`` as its own process on ``host`` (``env``: set in it beyond this
    one's, whose data token it does not get: an engine's API is control); returns (process, base URL)
    once healthy (``https://`` when ``auth`` has TLS).
    Its output goes to ``log_path``, else to an unnamed temporary file (a pipe nobody reads would
    block it); its end is shown if it fails to start."""
    import tempfile

    port = port or free_port()
    cmd = serve_command(
        "engine", "engine", [f"model_path={model_path}", f"port={port}", *host.bind(), *(extra or [])], config_path
    )
    out = open(log_path, "ab+") if log_path else tempfile.TemporaryFile()  # noqa: SIM115 (the process's)
    start = out.tell()
    proc = subprocess.Popen(
        host.command(cmd, env if host.wrap else None),
        stdout=out,
        stderr=subprocess.STDOUT,
        env=dict(engine_environment(), PYTHONUNBUFFERED="1", **(env or {})),
    )
    url = f"{auth.scheme if auth else 'http'}://{host.address}:{port}"
    try:
        wait_http_healthy(url + "/health", timeout_s, proc, auth)
    except (_Exited, TimeoutError) as e:
        stop_process(proc)
        out.seek(max(start, out.seek(0, os.SEEK_END) - 64 * 1024))
        lines = _text_lines(out.read().decode(errors="replace"))
        raise _failed(f"engine on port {port}", e, log_path, lines) from None
    except BaseException:
        stop_process(proc)
        raise
    return proc, url


def start_gateway_process(
    overrides: list[str],
    port: int,
    timeout_s: float = 60.0,
    config_path: str | None = None,
    log_path: Path | None = None,
    auth: AuthConfig | None = None,
    host: Host = LOCAL,
) -> tuple[subprocess.Popen, str]:
    """Run ``rollmesh serve gateway`` on ``port`` of ``host`` (agents are told where), holding the data
    token only; returns (process, base URL) once ``/health`` answers."""
    cmd = host.command(serve_command("gateway", "gateway", [f"port={port}", *host.bind(), *overrides], config_path))
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (lives as long as the process)
    stderr = subprocess.STDOUT if log_path else subprocess.DEVNULL
    since = out.tell() if log_path else 0
    proc = subprocess.Popen(cmd, stdout=out, stderr=stderr, env=environment_of(DATA_ONLY))
    url = f"{auth.scheme if auth else 'http'}://{host.address}:{port}"
    try:
        wait_http_healthy(url + "/health", timeout_s, proc, auth)
    except (_Exited, TimeoutError) as e:
        stop_process(proc)
        raise _failed("gateway", e, log_path, last_lines(log_path, since)) from None
    except BaseException:
        stop_process(proc)
        raise
    return proc, url


def start_provider_process(
    env: str,
    overrides: list[str] = (),
    grpc_port: int | None = None,
    http_port: int | None = None,
    timeout_s: float = 60.0,
    log_path: Path | None = None,
) -> tuple[subprocess.Popen, str, str]:
    """Run ``rollmesh serve env-provider --env ENV``; returns (process, gRPC address, HTTP base URL)
    once both answer. The same ports again start a provider in a killed one's place. It checks
    ``ROLLMESH_PROVIDER_TOKEN``, made here if this process has none (its clients read it too)."""
    ensure_provider_token()
    grpc_port, http_port = grpc_port or free_port(), http_port or free_port()
    cmd = serve_command(
        "env-provider", "env_provider", [f"grpc_port={grpc_port}", f"http_port={http_port}", *overrides]
    )
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (lives as long as the process)
    stderr = subprocess.STDOUT if log_path else out
    # The data token at most (for the mesh's reward service): a provider is no part of the control role.
    proc = subprocess.Popen([*cmd, "--env", env], stdout=out, stderr=stderr, env=environment_of(DATA_ONLY))
    address, url = f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"
    try:
        wait_grpc_healthy(address, timeout_s, proc)
        wait_http_healthy(url + "/health", timeout_s, proc)
    except BaseException:
        stop_process(proc)
        raise
    return proc, address, url


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it does not exit in time."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)


class RedisServer:
    """A redis-server on a free loopback port with AOF; tests kill -9 and restart it."""

    def __init__(self, data_dir: Path, appendfsync: str = "always", password: str | None = None, tls=None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: `make test` installs it (apt-get install redis-server)")
        self.binary, self.dir, self.port = binary, data_dir, free_port()
        self.appendfsync = appendfsync  # "always": an acknowledged write survives kill -9 and power loss
        self.proc: subprocess.Popen | None = None
        self.password = password  # given on stdin as configuration, never on the command line
        self.tls = tls  # a TlsConfig (cert, key, CA): TLS only, on the same port

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start (or restart, same port and directory) with AOF fsynced on every write."""
        args = [self.binary, "-", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        if self.tls:  # clients need no certificate of their own: the password is the credential
            args[2:4] = ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no"]
            args += ["--tls-cert-file", self.tls.cert_path, "--tls-key-file", self.tls.key_path]
            args += ["--tls-ca-cert-file", self.tls.ca_path]
        args += ["--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "", "--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if self.password:
            self.proc.stdin.write(f"requirepass {self.password}\n".encode())
        self.proc.stdin.close()
        import redis

        tls = dict(ssl=True, ssl_ca_certs=self.tls.ca_path) if self.tls else {}
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, password=self.password, **tls)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return self
            except redis.RedisError:
                time.sleep(0.05)
        self.kill9()  # not left running behind the error
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
