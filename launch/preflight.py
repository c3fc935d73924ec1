"""What a run needs before any of its processes starts: the credentials and files its config names.

`rollmesh run` checks these right after the config loads and, if any is missing, prints one line
each (the field or variable, what it is for) and exits 2 before it starts anything. Found later,
the same problem kills a service during start-up, its reason only in that service's log.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from services.engine.backends import backend


def problems(cfg) -> list[str]:
    """Everything the run ``cfg`` would stop on for want of a credential or a file, one line each."""
    return [*_models(cfg), *_tasks(cfg), *_keys(cfg), *_teachers(cfg)]


def _teachers(cfg) -> list[str]:
    """Each teacher's model, and its vocabulary the student's (it scores the student's token ids)."""
    from launch.teachers import vocabulary_problem

    out = []
    for t in cfg.teachers:
        if not (Path(t.model_path) / "config.json").is_file():
            out.append(f"teachers[{t.name}].model_path: no model at {t.model_path} (a directory with config.json)")
        elif (why := vocabulary_problem(cfg.env_manager.tokenizer_path or cfg.model_path, t)) is not None:
            out.append(why)
    return out


def _models(cfg) -> list[str]:
    """The model directories the processes load from (the engines', the trainer's, a reference's)."""
    named = {}
    if cfg.trainer.type != "sim":  # (the simulated ones load no model: a tokenizer at most)
        named = {"trainer.model_path": cfg.trainer.model_path, "trainer.ref_model_path": cfg.trainer.ref_model_path}
    if cfg.run.num_engines and backend(cfg.engine).loads_model:  # (none: a shared pool serves the policy)
        named["engine.model_path"] = getattr(cfg.engine, "model_path", None)
    return [
        f"{field}: no model at {path} (a directory with config.json: `rollmesh init-model` or a local copy)"
        for field, path in named.items()
        if path and not (Path(path) / "config.json").is_file()
    ]


def _tasks(cfg) -> list[str]:
    """Each domain's data files and its remote providers' token (its formatting functions are
    imported when the config loads)."""
    if cfg.run.rollout == "gateway":  # external agents make the rollouts: no EnvManager runs
        return []
    out = []
    for d in cfg.env_manager.task_domains():
        where = "env_manager" if not d.name else f"env_manager.domains[{d.name}]"
        env = d.env
        if env.type != "remote" and d.generate is None and d.dataset_path and not Path(d.dataset_path).is_file():
            out.append(f"{where}.dataset_path: no file {d.dataset_path} (the prompts to roll out, JSONL)")
        if d.heldout_path and not Path(d.heldout_path).is_file():
            out.append(f"{where}.heldout_path: no file {d.heldout_path} (the held-out prompts, JSONL)")
        if env.type == "verifiers" and not shutil.which(env.python):
            out.append(f"{where}.env.python: no interpreter {env.python} (the verifiers venv: `make verifiers`)")
        if env.type != "remote":
            continue
        if env.token_env and not cfg.auth.disabled and not os.environ.get(env.token_env):
            out.append(
                f"{where}.env.token_env: ${env.token_env} is not set: the token the environment providers at "
                f"{', '.join(env.addresses)} check (their own, never the mesh's); export it, or set "
                "env.token_env: null for providers that check none"
            )
    if cfg.run.heldout_path and not Path(cfg.run.heldout_path).is_file():
        out.append(f"run.heldout_path: no file {cfg.run.heldout_path} (the held-out prompts, JSONL)")
    return out


def _keys(cfg) -> list[str]:
    """Key files a service checks callers against (a missing one would refuse every caller)."""
    path = cfg.gateway.api_keys_path
    if cfg.env_manager.env.type == "verifiers" and path:
        return [
            "gateway.api_keys_path: a verifiers environment's driver uses the key rollmesh run issues; leave it out"
        ]
    if cfg.run.rollout == "gateway" and path and not Path(path).is_file():
        return [f"gateway.api_keys_path: no file {path} (the agents' keys: `rollmesh gateway-key {path} NAME`)"]
    return []
