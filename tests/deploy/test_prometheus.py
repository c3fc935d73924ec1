"""A real Prometheus against a running mesh: every dashboard and alert expression returns data.

The mesh is the quickstart cut down (real engine, LLMProxy, SampleBuffer, controller, EnvManager
and trainer processes on loopback), its task as two domains (the domains dashboard has data too);
Prometheus runs from ``deploy/prometheus/prometheus.yml`` with each job's targets swapped for the
mesh's loopback ports and a 1 s scrape interval.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from launch.config import load_config
from services.processes import free_port, stop_process

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
COMPARISON = re.compile(r"(>=|<=|==|!=|>|<)")


def _binary(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed: `make test` installs it (Debian package prometheus)"
    return path


@pytest.fixture(scope="module")
def live_mesh(tiny_model, tmp_path_factory):
    from launch.mesh import start_mesh, start_trainer

    run_dir = tmp_path_factory.mktemp("prom-run")
    overrides = [
        f"model_path={tiny_model}",
        "train_loop.steps=10000",
        f"train_loop.run_dir={run_dir}",
        "controller.groups_per_step=2",
        "env_manager.num_workers=4",
        "env_manager.episode.sampling.max_new_tokens=4",
        "buffer.filter_zero_variance=false",
        "reward_service.reward=digit_answer",  # the reward service too
    ]
    quickstart = yaml.safe_load(Path("examples/quickstart.yaml").read_text())
    task = {k: quickstart["env_manager"].pop(k) for k in ("dataset_path", "reward")} | {"reward": {"type": "service"}}
    quickstart["env_manager"]["domains"] = [{"name": name, **task} for name in ("digits", "letters")]
    config = run_dir / "quickstart-domains.yaml"
    config.write_text(yaml.safe_dump(quickstart))
    cfg = load_config(config, overrides)
    (run_dir / "logs").mkdir()
    mesh = start_mesh(cfg, config, overrides, run_dir / "logs")
    trainer = start_trainer(config, overrides, mesh, run_dir / "logs" / "trainer.log")
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and len(metrics.read_text().splitlines() if metrics.exists() else []) < 2:
            assert trainer.poll() is None, (run_dir / "logs" / "trainer.log").read_text()[-3000:]
            time.sleep(0.5)
        assert metrics.exists(), "the mesh never trained a step"
        yield mesh
    finally:
        stop_process(trainer)
        mesh.stop()


def test_each_process_of_the_mesh_holds_the_tokens_of_its_roles_only(live_mesh):
    """`rollmesh run` gives the control token (weights, suspend, commit) to the LLMProxy and the
    controller (and the trainer), never to the buffer, the reward service or the EnvManager; engines
    get the control token only."""
    from services.auth import CONTROL_TOKEN_ENV, TOKEN_ENV

    held = {}
    for s in live_mesh.services:
        environ = Path(f"/proc/{s.proc.pid}/environ").read_bytes().split(b"\0")
        names = {e.split(b"=", 1)[0].decode() for e in environ if e}
        held[s.name.split("-")[0] if s.name.startswith("engine") else s.name] = {
            n for n in (TOKEN_ENV, CONTROL_TOKEN_ENV) if n in names
        }
    both = {TOKEN_ENV, CONTROL_TOKEN_ENV}
    assert held == {
        "engine": {CONTROL_TOKEN_ENV},
        "llm-proxy": both,
        "controller": both,
        "sample-buffer": {TOKEN_ENV},
        "reward": {TOKEN_ENV},
        "env-manager": {TOKEN_ENV},
    }, held


@pytest.fixture(scope="module")
def prometheus(live_mesh, tmp_path_factory):
    """Prometheus scraping the live mesh with deploy/'s job names and alert rules."""
    work = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == set(live_mesh.metrics), "deploy/prometheus jobs and the mesh's services differ"
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": live_mesh.metrics[job["job_name"]]}]
    shutil.copy(ALERTS, work / "alerts.yml")
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            _binary("prometheus"),
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=open(work / "prometheus.log", "wb"),  # noqa: SIM115 (the process owns it until it stops)
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("prometheus not ready: " + (work / "prometheus.log").read_text()[-2000:])
        yield url
    finally:
        stop_process(proc)


def _query(url: str, expr: str) -> list:
    res = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert res["status"] == "success", f"{expr}: {res.get('error')}"
    return res["data"]["result"]


def with_bool(expr: str) -> str:
    """``A > B`` → ``A > bool B``: 0/1 for every series instead of only the firing ones, so an
    alert that is (rightly) not firing still shows that both of its sides have data."""
    depth, last = 0, None
    for i, ch in enumerate(expr):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0 and (m := COMPARISON.match(expr, i)) and expr[i - 1 : i + 1] not in ("=~", "!~"):
            last = m
    assert last is not None, f"alert expression without a top-level comparison: {expr}"
    return f"{expr[: last.end()]} bool{expr[last.end() :]}"


def dashboard_expressions() -> list[tuple[str, str]]:
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for t in panel["targets"]:
                expr = t["expr"].replace("$__rate_interval", "1m").replace("$domain", ".+")  # Grafana's variables
                out.append((f"{path.stem}: {panel['title']}", expr))
    return out


def alert_expressions() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [(r["alert"], with_bool(r["expr"])) for g in rules["groups"] for r in g["rules"]]


def test_with_bool_rewrites_only_the_top_level_comparison():
    assert with_bool('up{job=~"a|b"} == 0') == 'up{job=~"a|b"} == bool 0'
    assert with_bool("time() - max(x) > 900") == "time() - max(x) > bool 900"
    assert with_bool("predict_linear(d[30m], 3600) > c") == "predict_linear(d[30m], 3600) > bool c"


def test_promtool_accepts_the_config_and_the_rules():
    promtool = _binary("promtool")
    for args in (["check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")], ["check", "rules", str(ALERTS)]):
        res = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr


def test_every_service_metrics_pass_promtool_and_name_rules(live_mesh):
    promtool = _binary("promtool")
    assert set(live_mesh.metrics) == {
        "engine",
        "llm-proxy",
        "sample-buffer",
        "controller",
        "env-manager",
        "trainer",
        "reward",
    }
    for job, targets in live_mesh.metrics.items():
        text = httpx.get(f"http://{targets[0]}/metrics", timeout=10).text
        res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, f"{job}: {res.stdout}{res.stderr}"
        ours = {m.split()[2] for m in text.splitlines() if m.startswith("# HELP rollmesh_")}
        assert ours, f"{job} exposes no rollmesh_ metrics"
        helps = {m.split()[2]: m for m in text.splitlines() if m.startswith("# HELP ")}
        for name in ours:
            assert len(helps[name].split(None, 3)) == 4, f"{job}: {name} has no HELP text"


def test_every_dashboard_and_alert_expression_returns_data(prometheus):
    exprs = dashboard_expressions() + alert_expressions()
    assert len(exprs) > 40
    deadline = time.monotonic() + 90  # rate() and increase() need two scrapes in their window
    missing = exprs
    while missing and time.monotonic() < deadline:
        missing = [(where, e) for where, e in missing if not _query(prometheus, e)]
        if missing:
            time.sleep(2)
    assert not missing, "no data for:\n" + "\n".join(f"  {w}: {e}" for w, e in missing)


def test_prometheus_scrapes_every_service(prometheus):
    targets = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    assert {t["labels"]["job"] for t in targets} == {
        "engine",
        "llm-proxy",
        "sample-buffer",
        "controller",
        "env-manager",
        "trainer",
        "reward",
    }
    deadline = time.monotonic() + 30
    while any(t["health"] != "up" for t in targets) and time.monotonic() < deadline:
        time.sleep(1)
        targets = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    assert all(t["health"] == "up" for t in targets), [(t["labels"], t["lastError"]) for t in targets]
    rules = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert sum(len(g["rules"]) for g in rules) == len(alert_expressions())
    assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules
