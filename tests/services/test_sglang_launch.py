"""``engine.type: sglang``: the SGLang command is built with the flags RL needs, a bad config is
refused by field, and ``rollmesh serve engine`` really starts ``python -m sglang.launch_server``
(here a stand-in package that accepts SGLang's flag names, as no GPU is here), which the launcher
waits for and the LLMProxy drives like any engine, token and starting version included."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollout.engines.sglang.config import SGLangEngineConfig
from services.auth import AuthConfig, AuthError
from services.engine.sglang_server import SGLangNotInstalled, sglang_command
from services.processes import start_engine_process, stop_process
from tests.services.mesh import local_mesh

STANDIN_PACKAGE = Path(__file__).parent / "sglang_package"


def _flags(argv: list[str]) -> dict[str, str]:
    out, i = {}, 0
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i]] = argv[i + 1]
            i += 2
        else:
            out[argv[i]] = ""
            i += 1
    return out


def test_the_command_carries_the_flags_rl_needs(tiny_model):
    cfg = SGLangEngineConfig(
        model_path=tiny_model,
        python=sys.executable,
        port=31234,
        tensor_parallel_size=2,
        mem_fraction_static=0.6,
        weight_version=7,
        seed=3,
        extra_args=["--chunked-prefill-size", "4096"],
    )
    argv, env = sglang_command(cfg, AuthConfig(token="data", control_token="s3cret"))
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = _flags(argv[3:])
    assert flags["--model-path"] == str(Path(tiny_model).resolve()) and flags["--port"] == "31234"
    assert flags["--tp-size"] == "2" and flags["--mem-fraction-static"] == "0.6" and flags["--dtype"] == "bfloat16"
    assert flags["--weight-version"] == "7" and flags["--random-seed"] == "3" and "--enable-metrics" in flags
    assert flags["--chunked-prefill-size"] == "4096" and flags["--grammar-backend"] == "xgrammar"
    # The token is in a file only this user reads, never on the command line (ps shows it to all).
    secrets = Path(flags["--config"])
    assert "s3cret" not in " ".join(argv) and "--api-key" not in flags
    assert yaml.safe_load(secrets.read_text()) == {"api-key": "s3cret"}
    assert secrets.stat().st_mode & 0o777 == 0o600 and secrets.parent.stat().st_mode & 0o777 == 0o700
    # ... and in no file on disk: a link to a memory file of the process that execs SGLang.
    assert os.readlink(secrets).startswith("/proc/self/fd/") and "memfd:" in os.readlink(os.readlink(secrets))
    assert "--max-running-requests" not in flags and "--enable-memory-saver" not in flags  # SGLang's defaults
    memory_saver = _flags(
        sglang_command(cfg.model_copy(update={"enable_memory_saver": True}), AuthConfig(token="t"))[0]
    )
    assert "--enable-memory-saver" in memory_saver
    assert env["HF_HUB_OFFLINE"] == "1" and "ROLLMESH_TOKEN" not in env and "ROLLMESH_CONTROL_TOKEN" not in env


def test_a_bad_sglang_config_is_refused_by_field(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="^engine.model_path: .*no config.json"):
        sglang_command(SGLangEngineConfig(model_path=str(tmp_path), python=sys.executable), AuthConfig(token="t"))
    with pytest.raises(SGLangNotInstalled, match="^engine.python: .*sglang"):
        sglang_command(SGLangEngineConfig(model_path=tiny_model, python="no-such-python3"), AuthConfig(token="t"))
    with pytest.raises(AuthError):  # no token, and auth not switched off
        sglang_command(SGLangEngineConfig(model_path=tiny_model, python=sys.executable), AuthConfig(control_token=""))
    # Through the CLI: exit 2 and the field, not a traceback.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.cli",
            "serve",
            "engine",
            "--set",
            "engine.type=sglang",
            "--set",
            "engine.python=no-such-python3",
            "--set",
            f"engine.model_path={tiny_model}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "engine.python" in proc.stderr, proc.stderr[-2000:]


def test_serve_engine_launches_sglang_and_the_proxy_drives_it(tiny_model, tmp_path, monkeypatch):
    argv_file = tmp_path / "argv.json"
    path = os.pathsep.join([str(STANDIN_PACKAGE), str(Path.cwd()), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("SGLANG_STANDIN_ARGV", str(argv_file))
    proc, url = start_engine_process(
        tiny_model,
        extra=["type=sglang", f"python={sys.executable}", "dtype=float32", "weight_version=3"],
        timeout_s=120,
    )
    try:

        async def main():
            async with local_mesh(url, tiny_model) as mesh:
                out = await mesh.proxy_client.generate([1, 2, 3], 4, temperature=0.0, ignore_eos=True)
                return out, await mesh.proxy_client.stats()

        out, stats = asyncio.run(main())
        import httpx

        refused = httpx.get(url + "/get_model_info", timeout=10).status_code  # no token
    finally:
        stop_process(proc)
    argv = json.loads(argv_file.read_text())
    assert _flags(argv)["--weight-version"] == "3" and "--config" in argv and "--api-key" not in argv
    link = Path(_flags(argv)["--config"])  # SGLang read its key through it; the key is on no disk
    assert link.is_symlink() and os.readlink(link).startswith("/proc/self/fd/")
    assert len(out.output_ids) == 4 and out.weight_version == 3  # the version it was launched at
    assert stats.engines[0].healthy and stats.engines[0].weight_version == 3
    assert refused == 401
