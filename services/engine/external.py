"""Engines rollmesh starts but does not implement (vLLM, SGLang): ``rollmesh serve engine``
becomes their server (exec), so signals, exit code and process id are the engine's own, and a
supervisor that stops or kills this process stops it, with nothing left behind."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from services.auth import AuthConfig, AuthError


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
