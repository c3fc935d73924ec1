"""Engines rollmesh starts but does not implement (vLLM, SGLang): ``rollmesh serve engine``
becomes their server (exec), so signals, exit code and process id are the engine's own, and a
supervisor that stops or kills this process stops it, with nothing left behind."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from services.auth import AuthConfig, AuthError


def local_model_dir(cfg) -> Path:
    """``engine.model_path`` as a local model directory; ``ValueError`` naming the field otherwise
    (either server would take a missing directory for a model hub's name and try to download it)."""
    if cfg.model_path is None:
        raise ValueError("engine.model_path: not set (nor the run's model_path)")
    model = Path(cfg.model_path)
    if not (model / "config.json").exists():
        raise ValueError(f"engine.model_path: {cfg.model_path!r} is not a local model directory (no config.json)")
    return model


def exec_server(command: Callable, cfg, auth: AuthConfig, config_errors: tuple[type[Exception], ...]) -> None:
    """Exec ``command(cfg, auth)``'s argv and environment; a config error exits 2, naming the field."""
    try:
        argv, env = command(cfg, auth)
    except (*config_errors, ValueError, AuthError) as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
