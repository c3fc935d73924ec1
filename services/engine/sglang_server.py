"""``rollmesh serve engine`` with ``engine.type: sglang``: exec SGLang's server with the flags RL
needs. The same flags are in the Helm chart's engine template and the compose file's ``gpu``
profile (``tests/deploy`` checks they agree).

What RL needs of it: a local model only (``HF_HUB_OFFLINE``), the run's token (SGLang's
``api-key``, in a private ``--config`` file: on the command line every user of the host would
read it in ``ps``; SGLang then wants it on every route but /health and /metrics), the version it starts at
(``--weight-version``, which the LLMProxy reads before letting it serve), metrics for the
dashboards, and TLS where the run has it. Weight updates come later over HTTP: from disk, or
over a weight-update group the trainer hosts (``/init_weights_update_group``), which needs no
flag at launch.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import yaml

from rollout.engines.sglang.config import SGLangEngineConfig
from services.auth import AuthConfig, Role, environment_of
from services.engine.external import exec_server, local_model_dir

CHECKOUT = Path(__file__).resolve().parents[2]


class SGLangNotInstalled(RuntimeError):
    """No interpreter with SGLang where the config says."""


def interpreter(cfg: SGLangEngineConfig) -> str:
    if os.sep in cfg.python:
        path = Path(cfg.python) if Path(cfg.python).is_absolute() else CHECKOUT / cfg.python
        found = str(path) if path.exists() else None
    else:
        found = shutil.which(cfg.python)
    if found is None:
        raise SGLangNotInstalled(
            f"engine.python: no interpreter {cfg.python!r}; point it at an environment with SGLang "
            "(`pip install sglang` on a GPU machine; the GPU image has one)"
        )
    return found


def secret_config(values: dict[str, str]) -> str:
    """SGLang ``--config`` file of secret flags, on no disk: an anonymous in-memory file (memfd,
    mode 0600) this process keeps open across its exec of SGLang, named by a symlink
    ``secrets.yaml`` → ``/proc/self/fd/N`` in a directory of mode 0700 (SGLang wants a .yaml name).
    Only SGLang's process can read it through the link (``/proc/self`` is the reader's own), and it
    is gone with that process: what the environment is to a process, without the argv."""
    fd = os.memfd_create("rollmesh-sglang-secrets", 0)  # no MFD_CLOEXEC: it must survive the exec
    os.set_inheritable(fd, True)
    os.fchmod(fd, 0o600)
    os.write(fd, yaml.safe_dump(values).encode())
    link = Path(tempfile.mkdtemp(prefix="rollmesh-sglang-")) / "secrets.yaml"
    link.symlink_to(f"/proc/self/fd/{fd}")
    return str(link)


def sglang_command(cfg: SGLangEngineConfig, auth: AuthConfig) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of the SGLang server ``cfg`` describes."""
    model = local_model_dir(cfg)
    bearer = auth.bearer(Role.CONTROL)  # an engine's API is control; raises when this process has no control token
    argv = [
        interpreter(cfg),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model.resolve()),
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
        "--dtype",
        cfg.dtype,
        "--tp-size",
        str(cfg.tensor_parallel_size),
        "--random-seed",
        str(cfg.seed),
        "--weight-version",
        str(cfg.weight_version),
        "--enable-metrics",
        # grammars (json_schema / regex / ebnf) compiled by xgrammar, as the trainer replays their masks;
        # SGLang masks the logits before its sampler, so its log-probs are the masked distribution's
        "--grammar-backend",
        "xgrammar",
    ]
    for flag, value in (
        ("--mem-fraction-static", cfg.mem_fraction_static),
        ("--max-running-requests", cfg.max_running_requests),
        ("--context-length", cfg.context_length),
        ("--served-model-name", cfg.served_model_name),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if cfg.enable_memory_saver:
        argv.append("--enable-memory-saver")
    if cfg.enable_return_routed_experts:
        argv.append("--enable-return-routed-experts")
    if bearer:
        argv += ["--config", secret_config({"api-key": bearer.removeprefix("Bearer ")})]
    if auth.tls and auth.tls.cert_path and auth.tls.key_path:
        argv += ["--ssl-certfile", auth.tls.cert_path, "--ssl-keyfile", auth.tls.key_path]
    argv += cfg.extra_args
    # No token in SGLang's environment: it reads its key from the --config memory file only.
    env = dict(environment_of(set()), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    return argv, env


def serve(cfg: SGLangEngineConfig, auth: AuthConfig) -> None:
    """Become the SGLang server (``services/engine/external.py``)."""
    exec_server(sglang_command, cfg, auth, (SGLangNotInstalled,))
