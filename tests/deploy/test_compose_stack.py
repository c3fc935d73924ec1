"""The compose stack started for real (`make deploy-test`; minutes of image builds, so not in `make test`).

A Docker engine of the test's own (tests/deploy/docker_host.py) builds the CPU image from a Debian
base made here by debootstrap (``BASE_IMAGE``), with torch's CPU wheel from this machine's pip
(``deploy/docker/wheels``) and its CA (``deploy/docker/certs``); Redis and Prometheus run from one
Debian image in place of the registry images no registry here serves (the compose file's own
commands, ``REDIS_IMAGE``/``PROMETHEUS_IMAGE``). Then ``docker-compose up`` of the ``cpu`` and
``rewards`` profiles, with the shipped compose file's services, commands, health checks, volumes
and environment as they are; only the network is the host's (``network_mode: host``, each service
name resolving to 127.0.0.1 in every container, every port bound on loopback), since a private
bridge network would need the daemon to rewrite this machine's firewall. Grafana is not started:
no registry nor package here has its server (the dashboards' queries are checked against a live
mesh by tests/deploy/test_prometheus.py).

Checked: every service turns healthy by its own health check, the trainer trains steps, Prometheus
scrapes every target, the token is required, Redis refuses a client without its password, the
code sandbox runs inside the EnvManager's container with the compose file's settings, and ``down``
leaves no container, volume, network, link or firewall rule behind.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.docker_host import DockerDaemon, debian_base
from tests.deploy.waiting import wait_for as _wait_for

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROFILES = ("cpu", "rewards")
STEPS = 3

pytestmark = pytest.mark.deploy


def host_state() -> tuple[str, str]:
    """What a daemon could leave behind on the host: firewall rules and network links."""
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True, timeout=30).stdout
    rules = "\n".join(line for line in rules.splitlines() if not line.startswith("#"))
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30).stdout
    return rules, "\n".join(sorted(line.split(":")[1].strip() for line in links.splitlines()))


def host_network_compose(config: Path) -> dict:
    """The shipped compose file with the host's network: no ports nor networks of its own, every
    service name (and alias) resolving to loopback, Redis and Prometheus bound to loopback, and the
    run config ``config`` mounted where ``ROLLMESH_CONFIG`` points."""
    spec = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    names = set(spec["services"])
    for svc in spec["services"].values():
        for net in (svc.get("networks") or {}).values():
            names.update((net or {}).get("aliases", []))
    for svc in spec["services"].values():
        svc.pop("ports", None)
        svc.pop("networks", None)
        svc["network_mode"] = "host"
        svc["extra_hosts"] = [f"{n}:127.0.0.1" for n in sorted(names)]
        if str(svc.get("image", "")).startswith("rollmesh:"):
            svc["volumes"] = [*svc.get("volumes", []), f"{config}:/app/deploy/configs/test.yaml:ro"]
    redis = spec["services"]["redis"]
    redis["command"][-1] += " --bind 127.0.0.1"
    prometheus = spec["services"]["prometheus"]
    prometheus["entrypoint"] = ["prometheus"]
    prometheus["command"] = [*prometheus["command"], "--web.listen-address=127.0.0.1:9090"]
    return spec


def run_config(path: Path) -> Path:
    """deploy/configs/compose.yaml, every service on loopback, the trainer going on past the test."""
    cfg = yaml.safe_load((DEPLOY / "configs" / "compose.yaml").read_text())
    for section in cfg.values():
        if isinstance(section, dict):
            for key in ("host", "metrics_host"):
                if section.get(key) == "0.0.0.0":
                    section[key] = "127.0.0.1"
    cfg["train_loop"]["steps"] = 1000
    path.write_text(yaml.safe_dump(cfg))
    path.chmod(0o644)  # read by the containers' user
    return path


@pytest.fixture(scope="module")
def docker(tmp_path_factory):
    before = host_state()
    folder = tmp_path_factory.mktemp("docker")
    daemon = DockerDaemon(folder).start()
    try:
        yield daemon
    finally:
        daemon.stop()
        left = daemon.mounts()
        shutil.rmtree(folder, ignore_errors=True)
    assert not left, f"still mounted: {left}"
    assert host_state() == before, "the Docker engine changed the host's firewall or links"


def wait_for(what, timeout_s: float, message):
    return _wait_for(what, timeout_s, message, every_s=2)  # each look runs docker-compose: not too often


def build_images(docker: DockerDaemon, folder: Path) -> dict[str, float]:
    """The base, the CPU image and the Redis/Prometheus stand-in; seconds each took."""
    took = {}
    t = time.monotonic()
    base = debian_base(docker, folder)
    took["debian_base_s"] = time.monotonic() - t
    wheels, certs = DEPLOY / "docker" / "wheels", DEPLOY / "docker" / "certs"
    there = {*wheels.iterdir(), *certs.iterdir()}  # a user's own wheels and certificates stay
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheels)]
        + ["torch==2.13.0"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    try:
        assert got.returncode == 0, got.stderr
        assert list(wheels.glob("torch-2.13.0+cpu-*.whl")), (
            f"no CPU torch wheel from pip here: {list(wheels.iterdir())}"
        )
        shutil.copy("/etc/ssl/certs/ca-certificates.crt", certs / "rollmesh-test-host-ca.crt")
        t = time.monotonic()
        docker.run(
            "docker", "build", "--network", "host", "-f", "deploy/docker/Dockerfile.cpu", "-t", "rollmesh:cpu",
            "--build-arg", f"BASE_IMAGE={base}", "--build-arg", "TORCH_INDEX_URL=https://pypi.org/simple", ".",
            cwd=ROOT, timeout=900,
        )  # fmt: skip
    finally:  # the work tree as it was
        for path in {*wheels.iterdir(), *certs.iterdir()} - there:
            path.unlink()
    took["cpu_image_s"] = time.monotonic() - t
    t = time.monotonic()
    docker.run(
        "docker", "build", "--network", "host", "-t", "local/infra", "--build-arg", f"BASE_IMAGE={base}",
        "-f", "tests/deploy/images/Dockerfile.infra", "tests/deploy/images", cwd=ROOT, timeout=600,
    )  # fmt: skip
    took["infra_image_s"] = time.monotonic() - t
    return took


@pytest.mark.timeout(900)
def test_the_cpu_profile_trains_in_containers_and_down_leaves_nothing(docker, tmp_path):
    took = build_images(docker, tmp_path)
    size = docker.run("docker", "image", "inspect", "rollmesh:cpu", "--format", "{{.Size}}").stdout.strip()
    env = dict(
        ROLLMESH_TOKEN=secrets.token_urlsafe(16),
        ROLLMESH_CONTROL_TOKEN=secrets.token_urlsafe(16),
        ROLLMESH_REDIS_PASSWORD=secrets.token_urlsafe(16),
        ROLLMESH_CONFIG="deploy/configs/test.yaml",
        REDIS_IMAGE="local/infra",
        PROMETHEUS_IMAGE="local/infra",
    )
    compose_file = tmp_path / "docker-compose.yaml"
    compose_file.write_text(yaml.safe_dump(host_network_compose(run_config(tmp_path / "test.yaml"))))
    project = ["docker-compose", "-p", "rmtest", "-f", str(compose_file), "--project-directory", str(DEPLOY)]
    project += [a for p in PROFILES for a in ("--profile", p)]
    compose_env = dict(docker.env, **env)

    def compose(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        done = subprocess.run([*project, *args], capture_output=True, text=True, env=compose_env, timeout=timeout)
        assert not check or done.returncode == 0, f"{args}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
        return done

    services = ["redis", "engine-cpu", "llm-proxy", "sample-buffer", "controller", "env-manager", "reward"]
    services += ["trainer-cpu", "prometheus"]
    t0 = time.monotonic()
    compose("up", "-d", "--no-build", *services)
    try:
        # every service with a health check turns healthy by it
        def health() -> dict[str, str]:
            ids = compose("ps", "-q").stdout.split()
            fmt = '{{index .Config.Labels "com.docker.compose.service"}} '
            fmt += "{{if .State.Health}}{{.State.Health.Status}}{{end}}"
            out = docker.run("docker", "inspect", "--format", fmt, *ids)
            return dict((line.split() + [""])[:2] for line in out.stdout.splitlines())

        checked = {"redis", "engine-cpu", "llm-proxy", "sample-buffer", "controller", "env-manager", "reward"}
        states = wait_for(
            lambda: (h := health()) and checked <= set(h) and all(h[k] == "healthy" for k in checked) and h,
            300,
            lambda: f"not healthy: {health()}\n{compose('logs', '--tail', '30', check=False).stdout[-4000:]}",
        )
        assert set(states) >= set(services), states
        healthy_s = time.monotonic() - t0

        def trained() -> list[dict]:
            out = compose("exec", "-T", "trainer-cpu", "cat", "/runs/quickstart/metrics.jsonl", check=False).stdout
            return [json.loads(x) for x in out.splitlines() if x.strip()]

        first = wait_for(trained, 300, lambda: compose("logs", "--tail", "40", "trainer-cpu", check=False).stdout)
        first_step_s = time.monotonic() - t0
        steps = wait_for(lambda: len(s := trained()) >= STEPS and s, 300, "the trainer stopped training")
        assert [s["step"] for s in steps[:STEPS]] == list(range(1, STEPS + 1)), first

        # Prometheus scrapes every target of its config, each up
        def targets() -> list[dict]:
            answer = httpx.get("http://127.0.0.1:9090/api/v1/targets", timeout=5).json()
            return answer["data"]["activeTargets"]

        up = wait_for(
            lambda: (t := targets()) and all(x["health"] == "up" for x in t) and t,
            90,
            lambda: [(x["labels"]["job"], x["health"], x.get("lastError")) for x in targets()],
        )
        jobs = {x["labels"]["job"] for x in up}
        assert jobs == {"engine", "llm-proxy", "sample-buffer", "controller", "env-manager", "trainer", "reward"}

        # the token is required: the engine's HTTP API and a gRPC service
        assert httpx.get("http://127.0.0.1:30000/get_model_info", timeout=5).status_code == 401
        import grpc

        from services.pb.rollmesh.v1 import sample_buffer_pb2 as pb
        from services.pb.rollmesh.v1 import sample_buffer_pb2_grpc

        with grpc.insecure_channel("127.0.0.1:50052") as ch, pytest.raises(grpc.RpcError) as refused:
            sample_buffer_pb2_grpc.SampleBufferStub(ch).Stats(pb.BufferStatsRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # Redis: no client gets in without the password
        import redis

        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=6379, socket_timeout=5).ping()
        assert redis.Redis(host="127.0.0.1", port=6379, password=env["ROLLMESH_REDIS_PASSWORD"]).ping()

        # the code sandbox runs inside the EnvManager's container, as its unprivileged user, in a network
        # of its own: Redis listens on this loopback, and from inside the sandbox nothing does
        probe = (
            "from rollout.verifiers.sandbox import Sandbox\n"
            "r = Sandbox().run('import os, socket\\nprint(os.getuid())\\n"
            'socket.create_connection(("127.0.0.1", 6379), timeout=1)\', 10)\n'
            "print(r.outcome, r.stdout.strip(), r.stderr.strip().splitlines()[-1])"
        )
        out = compose("exec", "-T", "env-manager", "python", "-c", probe).stdout
        assert out.startswith("error 10001 ") and "Connection refused" in out, out
    finally:
        compose("down", "-v", "--remove-orphans", check=False, timeout=180)
    left = {
        what: docker.run("docker", what, "ls", "-q", *(["-a"] if what == "container" else [])).stdout.split()
        for what in ("container", "volume")
    }
    assert left == {"container": [], "volume": []}, left
    networks = docker.run("docker", "network", "ls", "--format", "{{.Name}}").stdout.split()
    assert set(networks) <= {"host", "none"}, networks
    print(json.dumps({**{k: round(v) for k, v in took.items()}, "cpu_image_bytes": int(size),
                      "up_to_healthy_s": round(healthy_s), "up_to_first_step_s": round(first_step_s)}))  # fmt: skip
