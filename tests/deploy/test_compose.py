"""docker-compose.yaml validates with the real docker-compose, and everything it names exists.

Only ``docker-compose config`` runs (no Docker daemon here): the file is valid, every build
context and Dockerfile exists, every command is a `rollmesh serve` service with a config that
loads, and the published ports are the ports those configs serve on.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from launch.commands.serve import SERVICES
from launch.config import load_config
from services.auth import AuthConfig
from services.engine.sglang_server import sglang_command

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "docker-compose.yaml"
# compose service → (config section, whether it serves gRPC on `port`)
SECTIONS = {
    "llm-proxy": "proxy",
    "sample-buffer": "buffer",
    "controller": "controller",
    "env-manager": "env_manager",
    "engine-cpu": "engine",
    "gateway": "gateway",
}


TOKEN = "compose-test-token"
CONTROL_TOKEN = "compose-test-control-token"
REDIS_PASSWORD = "compose-test-redis-password"


def _compose(env: dict) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is not installed: `make test` installs it (Debian package docker-compose)"
    return subprocess.run(
        [binary, "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", **env},
    )


def compose_config() -> dict:
    res = _compose(
        {"ROLLMESH_TOKEN": TOKEN, "ROLLMESH_CONTROL_TOKEN": CONTROL_TOKEN, "ROLLMESH_REDIS_PASSWORD": REDIS_PASSWORD}
    )
    assert res.returncode == 0, res.stderr
    return yaml.safe_load(res.stdout)


def test_each_service_gets_the_tokens_of_its_roles_and_compose_refuses_to_start_without_them(tiny_model):
    everything = {"ROLLMESH_TOKEN": TOKEN, "ROLLMESH_CONTROL_TOKEN": CONTROL_TOKEN, "ROLLMESH_REDIS_PASSWORD": "p"}
    for missing in everything:
        res = _compose({k: v for k, v in everything.items() if k != missing})
        assert res.returncode != 0 and missing in res.stderr, (missing, res.stderr)
    services = compose_config()["services"]
    ours = [n for n, s in services.items() if "build" in s]
    assert len(ours) == 10
    held = {
        name: {k for k in ("ROLLMESH_TOKEN", "ROLLMESH_CONTROL_TOKEN") if k in services[name]["environment"]}
        for name in ours
    }
    control_holders = {"llm-proxy", "controller", "trainer-cpu", "trainer-gpu", "engine-cpu", "engine-gpu"}
    for name in ours:
        assert ("ROLLMESH_CONTROL_TOKEN" in held[name]) == (name in control_holders), (name, held[name])
        # The runs volume (checkpoints the trainer reads back at resume) is the control role's only.
        runs = any(_source(v) == "runs" for v in services[name].get("volumes", []))
        assert runs == (name in control_holders), (name, services[name].get("volumes"))
        assert ("ROLLMESH_TOKEN" in held[name]) == (not name.startswith("engine")), (name, held[name])
        for key, value in (("ROLLMESH_TOKEN", TOKEN), ("ROLLMESH_CONTROL_TOKEN", CONTROL_TOKEN)):
            assert services[name]["environment"].get(key, value) == value
    # The GPU engine execs SGLang with the control token it got (api-key, in a private --config
    # file), which SGLang checks.
    cmd = services["engine-gpu"]["command"]
    assert cmd[:3] == ["rollmesh", "serve", "engine"]
    engine = load_config(ROOT / cmd[cmd.index("--config") + 1]).engine
    engine.python, engine.model_path = sys.executable, tiny_model
    auth = AuthConfig(token=None, control_token=services["engine-gpu"]["environment"]["ROLLMESH_CONTROL_TOKEN"])
    argv, _ = sglang_command(engine, auth)
    secrets = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())
    assert secrets == {"api-key": CONTROL_TOKEN} and argv[argv.index("--port") + 1] == "30000"


def _source(volume) -> str:
    """A volume's source, in the long (dict) or short (``src:dst[:mode]``) syntax."""
    return str(volume["source"]) if isinstance(volume, dict) else volume.split(":")[0]


def test_compose_file_is_valid_and_has_both_profiles():
    services = compose_config()["services"]
    profiles = {name: set(s.get("profiles", [])) for name, s in services.items()}
    assert {"redis", "prometheus", "grafana"} <= {n for n, p in profiles.items() if not p}, "always-on services"
    assert {"engine-cpu", "trainer-cpu"} <= {n for n, p in profiles.items() if p == {"cpu"}}
    assert {"engine-gpu", "trainer-gpu"} <= {n for n, p in profiles.items() if p == {"gpu"}}
    for shared in ("llm-proxy", "sample-buffer", "controller", "env-manager"):
        assert profiles[shared] == {"cpu", "gpu"}, shared
    assert profiles["gateway"] == {"agents"}  # added to either: external agents beside the EnvManager
    assert profiles["reward"] == {"rewards"}  # added to either: env_manager.reward {type: service}
    gpu = services["trainer-gpu"]
    assert gpu["command"][0] == "torchrun"
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_every_image_command_and_port_exists_in_the_project():
    services = compose_config()["services"]
    for name, s in services.items():
        if "build" in s:
            context = Path(s["build"]["context"])
            assert context == ROOT, name
            dockerfile = context / s["build"]["dockerfile"]
            assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
            for src in re.findall(r"^COPY (\S+)", dockerfile.read_text(), re.M):
                assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src} names nothing in the project"
        cmd = s.get("command") or []
        if "serve" in cmd:
            service = cmd[cmd.index("serve") + 1]
            assert service in SERVICES, f"{name}: `rollmesh serve {service}` is not a rollmesh service"
            config_path = ROOT / cmd[cmd.index("--config") + 1]
            cfg = load_config(config_path)  # validates against the real schema
            published = {int(p["target"]) for p in s.get("ports", [])}
            if name in SECTIONS:
                section = getattr(cfg, SECTIONS[name])
                assert section.port in published and section.host == "0.0.0.0", name
                if hasattr(section, "metrics_port"):
                    assert section.metrics_port in published, f"{name}: metrics port not published"
            if service == "trainer":
                assert cfg.train_loop.metrics_port in published and cfg.train_loop.metrics_host == "0.0.0.0"
        for volume in s.get("volumes", []):
            source = _source(volume)
            if source.startswith("/") and "deploy" in source:
                assert Path(source).exists(), f"{name}: mounts {source}, which does not exist"


def test_prometheus_targets_are_compose_services_on_their_metrics_ports():
    services = compose_config()["services"]
    names = set(services)
    for s in services.values():
        names |= set(((s.get("networks") or {}).get("default") or {}).get("aliases") or [])
    cfg = load_config(ROOT / "deploy" / "configs" / "compose.yaml")
    ports = {
        "engine": cfg.engine.port,
        "llm-proxy": cfg.proxy.metrics_port,
        "sample-buffer": cfg.buffer.metrics_port,
        "controller": cfg.controller.metrics_port,
        "env-manager": cfg.env_manager.metrics_port,
        "trainer": cfg.train_loop.metrics_port,
        "reward": cfg.reward_service.metrics_port,
    }
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    for job in prom["scrape_configs"]:
        for target in job["static_configs"][0]["targets"]:
            host, port = target.split(":")
            assert host in names, f"{job['job_name']}: {host} is not a compose service"
            assert int(port) == ports[job["job_name"]], f"{job['job_name']}: scrapes {port}"
    grafana = services["grafana"]["volumes"]
    assert any(_source(v).endswith("grafana/dashboards") for v in grafana)
    datasource = yaml.safe_load(
        (ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in services


def test_dashboards_are_what_make_dashboards_writes(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_dashboards", ROOT / "deploy/grafana/make_dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(tmp_path)
    for path in (ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"):
        assert (tmp_path / path.name).read_text() == path.read_text(), f"{path.name}: run make_dashboards.py"
    assert {p.name for p in tmp_path.iterdir()} == {"overview.json", "staleness.json", "health.json", "domains.json"}


def test_redis_asks_for_a_password_publishes_no_port_and_fsyncs_every_write():
    """Redis used to run open, published on the host: anyone reaching it could inject or flush
    training groups past the token. Only the buffer gets its password; it is never on a command line."""
    services = compose_config()["services"]
    redis = services["redis"]
    assert "ports" not in redis
    script = redis["command"][-1]
    assert "redis-server -" in script and "requirepass" in script and REDIS_PASSWORD not in script
    assert "--appendfsync always" in script
    assert redis["environment"]["ROLLMESH_REDIS_PASSWORD"] == REDIS_PASSWORD
    knows = {n for n, s in services.items() if "ROLLMESH_REDIS_PASSWORD" in (s.get("environment") or {})}
    assert knows == {"redis", "sample-buffer"}


def test_the_gateway_takes_agent_keys_from_a_file_that_ships_empty():
    gateway = compose_config()["services"]["gateway"]
    key_path = gateway["command"][-1].split("=", 1)[1]
    mounts = {}  # target -> (source, read-only), in the long or the short syntax
    for v in gateway["volumes"]:
        if isinstance(v, dict):
            mounts[v["target"]] = (v["source"], v.get("read_only", False))
        else:
            src, dst, *mode = v.split(":")
            mounts[dst] = (src, mode == ["ro"])
    # the directory, not the file: a key file replaced by `rollmesh gateway-key` is seen in the container
    key_dir = str(Path(key_path).parent)
    assert mounts[key_dir] == (str(ROOT / "deploy" / "gateway_keys"), True) and "/runs" not in mounts
    shipped = ROOT / "deploy" / "gateway_keys" / Path(key_path).name
    assert json.loads(shipped.read_text()) == {}  # no agent gets in by default
