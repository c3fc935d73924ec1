"""Import rules of ARCHITECTURE.md and the README's promises."""

import re
import subprocess
import sys
from pathlib import Path

RULES = {
    "rollout": {"trainer", "services"},
    "trainer": {"rollout", "services"},
    "sample_buffer": {"rollout", "trainer", "services"},
}


def test_import_direction():
    for pkg, banned in RULES.items():
        for f in Path(pkg).rglob("*.py"):
            for line in f.read_text().splitlines():
                m = re.match(r"\s*(?:from|import)\s+(\w+)", line)
                assert not (m and m.group(1) in banned), f"{f}: {line.strip()} breaks the import rule"


def test_the_loops_know_no_wire():
    """rollout/ and trainer/ (and the data model) import no gRPC or protobuf: only services/ knows sockets."""
    for pkg in ("rollout", "trainer", "sample_buffer"):
        for f in Path(pkg).rglob("*.py"):
            for line in f.read_text().splitlines():
                m = re.match(r"\s*(?:from|import)\s+([\w.]+)", line)
                assert not (m and m.group(1).split(".")[0] in {"grpc", "google"}), f"{f}: {line.strip()}"
                assert not (m and "_pb2" in m.group(1)), f"{f}: {line.strip()}"


def test_no_sglang_import_on_cpu_path():
    for pkg in ("rollout", "services", "trainer", "sample_buffer"):
        for f in Path(pkg).rglob("*.py"):
            assert not re.search(r"^\s*(import|from)\s+sglang", f.read_text(), re.M), f


def test_services_that_need_no_model_start_without_torch():
    """A restarted buffer, controller or proxy is back in about a second: reading the run config and
    importing these servers must not import torch or transformers (that import took 6 s here, most
    of a restart)."""
    servers = "services.sample_buffer.server, services.controller.server, services.llm_proxy.server"
    code = (
        f"import sys, services.config, {servers}; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing the config and the light servers imported {out.strip()}"


def test_readme_opens_with_the_two_commands_and_they_exist():
    readme = Path("README.md").read_text()
    first_block = readme.split("```")[1]
    assert "make run" in first_block and "make test" in first_block
    targets = subprocess.run(["make", "-qp"], capture_output=True, text=True).stdout
    for t in ("run", "test", "proto", "lint", "bench"):
        assert re.search(rf"^{t}:", targets, re.M), f"make {t} is missing"


def test_ci_runs_make_test():
    assert "make test" in Path(".ci/run").read_text()


def test_every_rollmesh_command_in_the_readme_exists():
    from typer.testing import CliRunner

    from services.cli import app

    found = re.findall(r"`rollmesh ((?:bench|serve) [a-z][a-z-]*|[a-z][a-z-]*)", Path("README.md").read_text())
    commands = set(found)
    assert {"run", "bench engine", "serve engine", "init-model"} <= commands
    for cmd in sorted(commands):
        res = CliRunner().invoke(app, [*cmd.split(), "--help"])
        assert res.exit_code == 0, f"`rollmesh {cmd}` in README.md does not exist: {res.output[-300:]}"
