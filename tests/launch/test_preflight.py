"""`rollmesh run`'s start-up errors, as a person reads them: what a run lacks (a credential, a file)
in one line each, exit 2, before any process starts; a service that dies while starting shown by
its own last lines and its log's path, never the launcher's traceback."""

from __future__ import annotations

import os
import subprocess

from services.auth import PROVIDER_TOKEN_ENV
from tests.test_run_e2e import quickstart_cmd


def _run(cmd: list[str], **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != PROVIDER_TOKEN_ENV}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**base, **env})


def test_a_remote_environment_without_its_token_stops_the_run_before_anything_starts(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    remote = "env_manager.env={type: remote, protocol: http, addresses: ['http://127.0.0.1:9']}"
    proc = _run(quickstart_cmd(tiny_model, run_dir, remote))
    errors = [x for x in proc.stdout.splitlines() if x.startswith("config error")]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(errors) == 1 and f"env_manager.env.token_env: ${PROVIDER_TOKEN_ENV} is not set" in errors[0], errors
    assert "http://127.0.0.1:9" in errors[0] and "Traceback" not in proc.stdout + proc.stderr
    assert not (run_dir / "logs").exists()  # no process was started
    # given the token, the same config gets past the check (and stops later, on the absent provider)
    from launch.config import load_config
    from launch.preflight import problems

    cfg = load_config("examples/quickstart.yaml", [f"model_path={tiny_model}", remote])
    os.environ[PROVIDER_TOKEN_ENV] = "t"
    try:
        assert problems(cfg) == []
    finally:
        del os.environ[PROVIDER_TOKEN_ENV]


def test_every_missing_file_is_named_at_once(tiny_model, tmp_path):
    from launch.config import load_config
    from launch.preflight import problems

    cfg = load_config(
        "examples/quickstart.yaml",
        [
            f"model_path={tmp_path / 'no-model'}",
            f"engine.model_path={tiny_model}",
            f"env_manager.dataset_path={tmp_path / 'no-train.jsonl'}",
            f"run.heldout_path={tmp_path / 'no-heldout.jsonl'}",
        ],
    )
    found = problems(cfg)
    assert [x.split(":")[0] for x in found] == ["trainer.model_path", "env_manager.dataset_path", "run.heldout_path"]
    assert all(str(tmp_path) in x for x in found), found
    # the simulated engine loads no model: its model_path is a tokenizer's at most
    sim = load_config("examples/quickstart.yaml", [f"model_path={tmp_path / 'tokenizer-only'}", "engine={type: sim}"])
    assert not [x for x in problems(sim) if x.startswith("engine.")]
    proc = _run(quickstart_cmd(tmp_path / "no-model", tmp_path / "run"))
    assert proc.returncode == 2 and "engine.model_path: no model at" in proc.stdout, proc.stdout[-2000:]


class Broken:
    """An environment whose constructor fails: the EnvManager builds one at start-up and dies."""

    def __init__(self, rows, reward_fn, **args) -> None:
        raise RuntimeError("the answer key is not where it was promised")


def test_a_service_that_dies_while_starting_is_shown_by_its_last_lines_and_log(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    cmd = quickstart_cmd(
        tiny_model, run_dir, "env_manager.env={type: custom, cls: 'tests.launch.test_preflight:Broken'}"
    )
    proc = _run(cmd, PYTHONPATH=os.getcwd())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "env-manager exited with code 1 during start-up" in out, out[-3000:]
    assert "the answer key is not where it was promised" in out
    assert f"its log: {run_dir / 'logs' / 'env_manager.log'}" in out
    assert 'launch/run.py", line' not in out and 'launch/mesh.py", line' not in out  # no launcher frames
    leftovers = subprocess.run(["pgrep", "-f", f"train_loop.run_dir={run_dir}"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""  # what had started was stopped


def test_the_launcher_s_start_up_error_reads_the_log_from_where_this_start_began(tmp_path):
    from services.processes import StartupError, last_lines

    log = tmp_path / "x.log"
    log.write_text("an earlier start's error\n")
    since = log.stat().st_size
    with open(log, "a") as f:
        f.write("loading\n\nValueError: bad thing\n")
    assert last_lines(log, since) == ["loading", "ValueError: bad thing"]
    text = str(StartupError("buffer", "exited with code 1", log, last_lines(log, since)))
    assert text.splitlines() == [
        "buffer exited with code 1 during start-up",
        "  | loading",
        "  | ValueError: bad thing",
        f"  its log: {log}",
    ]
