"""Import rules of ARCHITECTURE.md and the README's promises."""

import re
import subprocess
import sys
from pathlib import Path

RULES = {
    "rollout": {"trainer", "services", "launch"},
    "trainer": {"rollout", "services", "launch"},
    "sample_buffer": {"rollout", "trainer", "services", "launch"},
    # the services (servers, clients, wire plumbing) never reach into the launcher, its CLI or benchmarks
    "services": {"launch"},
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
    for pkg in ("rollout", "services", "trainer", "sample_buffer", "launch"):
        for f in Path(pkg).rglob("*.py"):
            assert not re.search(r"^\s*(import|from)\s+sglang", f.read_text(), re.M), f


def test_services_that_need_no_model_start_without_torch():
    """A restarted buffer, controller or proxy is back in about a second: reading the run config and
    importing these servers must not import torch or transformers (that import took 6 s here, most
    of a restart)."""
    servers = "services.sample_buffer.server, services.controller.server, services.llm_proxy.server"
    code = (
        f"import sys, launch.config, {servers}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
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

    from launch.cli import app

    found = re.findall(r"`rollmesh ((?:bench|serve) [a-z][a-z-]*|[a-z][a-z-]*)", Path("README.md").read_text())
    commands = set(found)
    assert {"run", "bench engine", "serve engine", "init-model"} <= commands
    for cmd in sorted(commands):
        res = CliRunner().invoke(app, [*cmd.split(), "--help"])
        assert res.exit_code == 0, f"`rollmesh {cmd}` in README.md does not exist: {res.output[-300:]}"


PRODUCT = ("rollout", "trainer", "sample_buffer", "services", "launch")


def _product_modules() -> dict[str, Path]:
    mods = {}
    for pkg in PRODUCT:
        for f in Path(pkg).rglob("*.py"):
            if "pb" not in f.parts:  # generated protobuf stubs
                name = ".".join(f.with_suffix("").parts)
                mods[name.removesuffix(".__init__")] = f
    return mods


def _imports(tree) -> list[str]:
    """Every module an import statement anywhere names: in functions and TYPE_CHECKING blocks too,
    because a lazy or type-only import is still a dependency a reader must follow."""
    import ast

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return found


def test_no_import_circle_among_product_modules():
    """A circle (A imports B, B imports A, directly or around a loop) means neither can be read,
    tested or replaced alone: configs do not build their implementations, strategies see the loop
    through a protocol, each transport's module owns both its config and its publisher."""
    import ast

    mods = _product_modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for m, f in mods.items():
        for target in _imports(ast.parse(f.read_text())):
            r = resolve(target)
            if r and r != m and not m.startswith(r + "."):  # a module's own package is not a dependency
                graph[m].add(r)
    # Depth-first search; a back edge to a module on the current path closes a circle.
    state, path, circles = {}, [], []

    def visit(m: str) -> None:
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                circles.append(path[path.index(n) :] + [n])
            elif n not in state:
                visit(n)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_simulator_loads_no_model_library():
    """The latency simulator shares the engine contract (rollout/engines/contract.py), not the
    embedded engine's module: it starts without torch."""
    code = "import sys, rollout.engines.sim.engine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_engine_backends_and_weight_transports_are_asked_not_named():
    """What differs between engines lives in services/engine/backends.py (and between transports in
    services/weight_transports/): elsewhere nothing compares engine.type, proxy.engine_api or
    publisher.type with a name."""
    allowed = {Path("services/engine/backends.py")}
    pattern = re.compile(r"\b(engine\.type|engine_api|publisher\.type)\s*(==|!=|\bin\b|\bnot in\b)\s*[\"'(\[{]")
    hits = [
        f"{f}:{i}: {line.strip()}"
        for pkg in PRODUCT
        for f in Path(pkg).rglob("*.py")
        if f not in allowed and "pb" not in f.parts
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "ask the registry instead:\n" + "\n".join(hits)


def test_every_registered_variant_has_its_implementation():
    """Each registry lists its names once; what pairs with them covers exactly those names."""
    from typing import get_args

    from rollout.envs.remote import PROTOCOLS
    from services.engine.backends import ALL_TRANSPORTS, BACKENDS, ENGINE_APIS
    from services.env_provider.clients import CLIENTS
    from services.weight_transports import ENGINE_ROUTES, TRANSPORTS

    assert set(CLIENTS) == set(PROTOCOLS)
    assert set(TRANSPORTS) == ALL_TRANSPORTS == set(ENGINE_ROUTES)  # both sides of each transport
    for name, b in BACKENDS.items():
        assert get_args(b.config.model_fields["type"].annotation) == (name,)
        assert b.api in ENGINE_APIS and b.transports <= ALL_TRANSPORTS
        assert callable(b.serve_fn())


def test_the_formatter_is_configured_not_fought():
    """`ruff format` (line length 120, pyproject.toml) decides the layout; `# fmt: skip` is a rare
    exception (there were 592, each keeping a hand layout the formatter would have changed)."""
    skips = [
        f"{f}:{i}"
        for f in Path(".").glob("[!.]*/**/*.py")
        if "pb" not in f.parts
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert len(skips) < 20, f"{len(skips)} formatter exceptions: {skips[:5]}"


def test_clients_and_shared_modules_import_no_server():
    """A client needs its server's wire limits and errors, not its server: those live in modules
    both sides import (``services/wire_limits.py``, ``services/<service>/errors.py``)."""
    import ast

    mods = _product_modules()
    sides = [m for m in mods if m.endswith(".client") or m.startswith("services.weight_transports")]
    sides += ["services.convert"]
    wrong = {
        m: sorted({t for t in _imports(ast.parse(mods[m].read_text())) if t.rsplit(".", 1)[-1] == "server"})
        for m in sides
    }
    assert not {m: t for m, t in wrong.items() if t}, wrong
