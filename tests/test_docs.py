"""The docs stay true to the code: the generated config reference is current, every config key the
README and docs/ name exists, the README stays a front door, and `rollmesh config --show` resolves."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from launch.config_docs import config_keys, render

DOCS = [Path("README.md"), *sorted(Path("docs").glob("*.md")), *sorted(Path("examples").rglob("*.md"))]
# A backticked dotted name (optionally `=value` or `: value` after it): `env_manager.scheduling: tail`.
DOTTED = re.compile(r"`([a-z_][a-z_0-9]*(?:\.[a-z_][a-z_0-9]*)+)(?:\s*[=:][^`]*)?`")
FILE_SUFFIXES = {"py", "json", "jsonl", "yaml", "md", "png", "jinja", "proto", "txt", "toml", "sh"}
# Named in the docs, and not config keys: fields of a trajectory's metadata, and SGLang's launcher.
NOT_CONFIG = {
    "metadata.timeout",
    "metadata.error_kind",
    "metadata.turn_temperatures",
    "sglang.launch_server",
    "meta_info.routed_experts",  # SGLang's answer fields
    "meta_info.input_token_logprobs",
    "meta_info.input_top_logprobs",
    "kernel.unprivileged_userns_clone",
}  # (a sysctl)


def _helm_keys() -> set[str]:
    values = yaml.safe_load(Path("deploy/helm/rollmesh/values.yaml").read_text())
    keys, todo = set(), [("", values)]
    while todo:
        prefix, node = todo.pop()
        for k, v in node.items():
            keys.add(prefix + k)
            if isinstance(v, dict):
                todo.append((prefix + k + ".", v))
    return keys


def _python_name(name: str) -> bool:
    """``name`` is a module, or an attribute of one (`torch.autocast`)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_the_config_reference_is_generated_from_the_models():
    assert Path("docs/config.md").read_text() == render(), "docs/config.md is stale: run `rollmesh config --docs`"


def test_every_config_key_the_docs_name_exists():
    """A dotted name in backticks is a config key (whole, or the tail of one: `episode.latency_penalty`
    inside `env_manager`), a Helm value, a file, or a Python module; anything else is a wrong claim."""
    keys, helm = config_keys(), _helm_keys()
    tails = {".".join(k.split(".")[i:]) for k in keys for i in range(len(k.split(".")))}
    wrong = []
    for path in DOCS:
        for m in DOTTED.finditer(path.read_text()):
            name = m.group(1)
            if name in tails or name in helm or name in NOT_CONFIG or name.rsplit(".", 1)[1] in FILE_SUFFIXES:
                continue
            if _python_name(name):
                continue
            wrong.append(f"{path}: {name}")
    assert not wrong, "keys named in the docs that no config model has:\n" + "\n".join(wrong)


def test_the_readme_is_a_front_door():
    assert len(Path("README.md").read_text().splitlines()) <= 150


def test_config_show_prints_the_resolved_config_with_secrets_masked():
    cmd = [
        sys.executable,
        "-m",
        "launch.cli",
        "config",
        "--show",
        "examples/quickstart.yaml",
        "--set",
        "engine.max_running_requests=7",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, env=dict(os.environ, ROLLMESH_TOKEN="s3cret-value")
    )
    assert proc.returncode == 0, proc.stderr
    shown = yaml.safe_load(proc.stdout)
    assert shown["engine"]["max_running_requests"] == 7  # the override
    assert shown["model_path"] == "models/tiny-digits"  # the file
    assert shown["trainer"]["loss"]["clip_low"] == 0.2  # a default nobody wrote
    assert shown["controller"]["state_path"] == str(Path(shown["train_loop"]["run_dir"]) / "controller.json")
    assert "s3cret-value" not in proc.stdout and shown["auth"]["token"] == "**********"


def test_config_show_names_a_bad_key_and_exits_2():
    cmd = [
        sys.executable,
        "-m",
        "launch.cli",
        "config",
        "--show",
        "examples/quickstart.yaml",
        "--set",
        "engine.max_runing_requests=7",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown key 'engine.max_runing_requests'" in proc.stderr


def test_every_relative_link_in_the_docs_points_at_a_file():
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path}: {target}")
    assert not broken, broken


def test_the_front_door_names_no_path_outside_the_repository_and_the_makefile_only_docs_that_exist():
    """A clone has no ``../shared``: the README points only into the repository; every ``docs/...``
    page the Makefile's comments name is there."""
    assert "../" not in Path("README.md").read_text()
    named = re.findall(r"docs/[\w./-]+\.md", Path("Makefile").read_text())
    assert named and not [p for p in named if not Path(p).exists()], named
