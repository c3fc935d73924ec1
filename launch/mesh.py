"""The mesh `rollmesh run` starts: every service as its own local process on loopback.

Order: engines → LLMProxy → SampleBuffer → AsyncController → (reward service) → EnvManager or
agent gateway; the trainer last. Each is waited on for health before the next starts; on a
failure everything started so far is stopped. Logs go to ``RUN_DIR/logs/<service>.log``.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from launch.device_map import Placement
from launch.supervisor import Supervised
from services.auth import Role, environment_of
from services.processes import (
    DATA_ONLY,
    LOCAL,
    Host,
    free_port,
    serve_command,
    start_engine_process,
    start_gateway_process,
    start_service_process,
    stop_process,
)


@dataclass
class Mesh:
    """The services of a running mesh (the trainer is started separately)."""

    services: list[Supervised]
    engine_urls: list[str]
    proxy: str
    buffer: str
    controller: str
    metrics: dict[str, list[str]] = field(default_factory=dict)  # Prometheus job → host:port targets
    gateway: str = ""  # the agent gateway's base URL, where run.rollout is gateway
    reward: str = ""  # the reward service's address, where the run starts one
    env_manager: str = ""  # the EnvManager's gRPC address, where the run starts one
    agent_key: str = ""  # the file holding the key `rollmesh run` issued its agents (no key file given)
    teachers: dict[str, str] = field(default_factory=dict)  # each teacher's LLMProxy address, by name
    hosts: Hosts = field(default_factory=lambda: Hosts())  # where each process runs

    def metrics_port(self, job: str, host: Host = LOCAL) -> str:
        """A free port for ``job``'s /metrics on ``host``, recorded as a scrape target."""
        port = free_port()
        self.metrics.setdefault(job, []).append(f"{host.address}:{port}")
        return str(port)

    def write_scrape_targets(self, path: Path) -> None:
        """Prometheus file_sd targets of this mesh (what `deploy/prometheus` scrapes in a cluster)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([{"targets": t, "labels": {"job": job}} for job, t in self.metrics.items()]))

    @property
    def wiring(self) -> list[str]:
        """``--set`` overrides that point a client (EnvManager, trainer) at this mesh."""
        wiring = [f"mesh.proxy={self.proxy}", f"mesh.buffer={self.buffer}", f"mesh.controller={self.controller}"]
        wiring += [f"mesh.reward={self.reward}"] if self.reward else []
        return wiring + [f"mesh.teachers.{name}={address}" for name, address in self.teachers.items()]

    def stop(self) -> None:
        for s in reversed(self.services):
            stop_process(s.proc)


@dataclass
class Hosts:
    """Where each process of the mesh runs: all here on loopback (``rollmesh run``), or job steps on
    the nodes of a SLURM allocation (``launch/slurm.py``): the engines on theirs, the rest on one."""

    services: Host = LOCAL  # LLMProxy, SampleBuffer, controller, reward, EnvManager, gateway, trainer
    engines: list[Host] = field(default_factory=list)  # engine i's; none listed: ``services``

    def engine(self, i: int) -> Host:
        return self.engines[i % len(self.engines)] if self.engines else self.services


# The processes that hold the control token (services/auth.py): the LLMProxy, the AsyncController
# and the trainer hold both; engines the control token only; every other service the data token only.
ENGINE_ROLES = frozenset({Role.CONTROL})


def cuda_env(name: str | None) -> dict[str, str]:
    return {} if name is None else {"CUDA_VISIBLE_DEVICES": name}


def needs_reward_service(cfg) -> bool:
    """The task's reward is the mesh's reward service (``{type: service}``, no address of its own): the
    EnvManager's episodes and the held-out evaluation score there."""
    return any(
        not isinstance(d.reward, str) and d.reward.type == "service" and d.reward.address is None
        for d in cfg.env_manager.task_domains()
    )


def start_mesh(
    cfg,
    config_path: Path,
    overrides: list[str],
    logs: Path,
    placement: Placement | None = None,
    hold_rollouts: bool = False,
    hosts: Hosts | None = None,
) -> Mesh:
    """Engines → LLMProxy → SampleBuffer → AsyncController → (reward service) → EnvManager, each
    healthy before the next (engines on the GPUs ``placement`` gives them, on ``hosts``). On any
    failure everything started so far is stopped. ``hold_rollouts``: the EnvManager waits for ``Start``."""
    placement = placement or Placement([None] * cfg.run.num_engines, None, cfg.run.trainer_procs)
    hosts = hosts or Hosts()
    mesh = Mesh([], [], "", "", "", hosts=hosts)
    host = hosts.services
    up = dict(config_path=str(config_path), timeout_s=cfg.run.startup_timeout_s, auth=cfg.auth, host=host)
    try:
        if cfg.run.num_engines:
            _start_engines_and_proxy(cfg, config_path, overrides, logs, placement, mesh, up)
        else:  # a shared pool's: this run's tokens tell it which run's lane its calls are
            mesh.proxy = cfg.mesh.proxy
        for teacher in cfg.teachers:
            _start_teacher(cfg, config_path, overrides, logs, teacher, mesh, up)
        proc, mesh.buffer = start_service_process(
            "sample-buffer",
            "buffer",
            [*overrides, f"buffer.metrics_port={mesh.metrics_port('sample-buffer', host)}"],
            log_path=logs / "buffer.log",
            roles=DATA_ONLY,
            **up,
        )
        mesh.services.append(Supervised("sample-buffer", proc, logs / "buffer.log", roles=DATA_ONLY))
        ctl = [
            *overrides,
            f"mesh.proxy={mesh.proxy}",
            f"mesh.buffer={mesh.buffer}",
            f"controller.metrics_port={mesh.metrics_port('controller', host)}",
        ]
        proc, mesh.controller = start_service_process(
            "controller", "controller", ctl, log_path=logs / "controller.log", **up
        )
        mesh.services.append(Supervised("controller", proc, logs / "controller.log"))
        if needs_reward_service(cfg):
            proc, mesh.reward = start_service_process(
                "reward",
                "reward_service",
                [*overrides, *mesh.wiring, f"reward_service.metrics_port={mesh.metrics_port('reward', host)}"],
                log_path=logs / "reward.log",
                roles=DATA_ONLY,
                **up,
            )
            mesh.services.append(Supervised("reward", proc, logs / "reward.log", roles=DATA_ONLY))
        if cfg.run.rollout == "gateway" or verifiers_env(cfg):  # agents (a verifiers environment's) make them
            keys = [] if cfg.gateway.api_keys_path else [f"gateway.api_keys_path={agent_key(logs.parent, mesh)}"]
            proc, mesh.gateway = start_gateway_process(
                [*overrides, *mesh.wiring, *keys], cfg.gateway.port or free_port(), log_path=logs / "gateway.log", **up
            )
            mesh.metrics["gateway"] = [mesh.gateway.split("://", 1)[1]]  # /metrics beside the API
            mesh.services.append(Supervised("gateway", proc, logs / "gateway.log", roles=DATA_ONLY))
            if verifiers_env(cfg):
                mesh.services.append(start_verifiers_driver(cfg, mesh, logs))
        else:
            env = [*overrides, *mesh.wiring, f"env_manager.metrics_port={mesh.metrics_port('env-manager', host)}"]
            held = ["env_manager.autostart=false"] if hold_rollouts else []
            proc, mesh.env_manager = start_service_process(
                "env-manager", "env_manager", [*env, *held], log_path=logs / "env_manager.log", roles=DATA_ONLY, **up
            )
            # A restarted EnvManager starts its workers itself: nobody is there to call Start again.
            restart = [*proc.args, "--set", "env_manager.autostart=true"] if hold_rollouts else None
            mesh.services.append(
                Supervised("env-manager", proc, logs / "env_manager.log", restart_args=restart, roles=DATA_ONLY)
            )
    except BaseException:
        mesh.stop()
        raise
    return mesh


def _start_engines_and_proxy(cfg, config_path, overrides, logs, placement, mesh: Mesh, up: dict) -> None:
    """The engines (in parallel, on the GPUs ``placement`` gives them), then the LLMProxy in front."""
    n = cfg.run.num_engines
    envs = [cuda_env(placement.engines[i]) for i in range(n)]
    names = [f"engine-{i}" for i in range(n)]
    where = [mesh.hosts.engine(i) for i in range(n)]
    pool = (cfg, config_path, overrides, logs, mesh)
    mesh.engine_urls += _start_engine_pool(*pool, cfg.engine.model_path, names, envs, where)
    mesh.metrics["engine"] = [u.split("://", 1)[1] for u in mesh.engine_urls]  # /metrics beside the API
    mesh.proxy = _start_proxy(overrides, mesh.engine_urls, "llm-proxy", logs / "proxy.log", mesh, up)


def _start_teacher(cfg, config_path, overrides, logs, teacher, mesh: Mesh, up: dict) -> None:
    """A teacher's engines (the engine section's settings, its model) and its own LLMProxy, each
    supervised and restarted like the policy's; not placed on GPUs (the config refuses a placement)."""
    tag, n = f"teacher-{teacher.name}", teacher.num_engines
    names = [f"{tag}-engine-{i}" for i in range(n)]
    # Last: the run's own overrides may name the policy's model_path, which is not the teacher's.
    pool = (cfg, config_path, [*overrides, f"engine.model_path={teacher.model_path}"], logs, mesh)
    urls = _start_engine_pool(*pool, teacher.model_path, names, [cuda_env(None)] * n, [mesh.hosts.services] * n)
    mesh.metrics[f"{tag}-engine"] = [u.split("://", 1)[1] for u in urls]  # /metrics beside the API
    mesh.teachers[teacher.name] = _start_proxy(overrides, urls, f"{tag}-proxy", logs / f"{tag}-proxy.log", mesh, up)


def _start_engine_pool(cfg, config_path, overrides, logs, mesh: Mesh, model_path, names, envs, hosts) -> list[str]:
    """Engines of ``model_path``, one per name, loading in parallel, supervised; their URLs."""

    def engine(i):
        return start_engine_process(
            model_path,
            free_port(),
            overrides,
            cfg.run.startup_timeout_s,
            str(config_path),
            cfg.auth,
            envs[i],
            hosts[i],
            logs / f"{names[i]}.log",
        )

    with ThreadPoolExecutor(len(names)) as pool:
        futures = [pool.submit(engine, i) for i in range(len(names))]
    started = [f.result() for f in futures if f.exception() is None]
    mesh.services += [  # before any failure is raised: the mesh stops what did start
        Supervised(names[i], p, logs / f"{names[i]}.log", env=envs[i], roles=ENGINE_ROLES)
        for i, (p, _) in enumerate(started)
    ]
    for f in futures:
        if f.exception() is not None:
            raise f.exception()
    return [u for _, u in started]


def _start_proxy(overrides, urls: list[str], name: str, log: Path, mesh: Mesh, up: dict) -> str:
    """An LLMProxy in front of ``urls``, supervised as ``name`` (its /metrics the job of that name),
    writing to ``log``; its address."""
    args = [*overrides, f"proxy.engine_urls=[{','.join(urls)}]"]
    args.append(f"proxy.metrics_port={mesh.metrics_port(name, mesh.hosts.services)}")
    proc, address = start_service_process("llm-proxy", "proxy", args, log_path=log, **up)
    mesh.services.append(Supervised(name, proc, log))
    return address


def verifiers_env(cfg):
    """The run's verifiers environment (``env_manager.env: {type: verifiers}``), or None."""
    env = cfg.env_manager.env
    return env if env.type == "verifiers" else None


def start_verifiers_driver(cfg, mesh: Mesh, logs: Path) -> Supervised:
    """The verifiers environment's driver (``services/verifiers_driver/``), in the environment's own
    venv, playing its rollouts through this run's gateway with the key issued to its agents."""
    env, em = verifiers_env(cfg), cfg.env_manager  # preflight: no gateway.api_keys_path, so agent_key is ours
    sampling = em.episode.sampling
    spec = {
        "gateway": mesh.gateway,
        "key_file": mesh.agent_key,
        "name": env.name,
        "args": env.args,
        "path": [str(Path(p).resolve()) for p in env.path],
        "model": cfg.gateway.model_name,
        "group_size": em.group_size,
        "concurrency": env.concurrency,
        "sampling_args": {"temperature": sampling.temperature, "max_tokens": sampling.max_new_tokens},
        "request_timeout_s": cfg.gateway.sessions.request_timeout_s,
        "rollouts_log": str(logs.parent / "verifiers_rollouts.jsonl"),
        "seed": em.seed,
    }
    path = logs.parent / "verifiers_driver.json"
    path.write_text(json.dumps(spec, indent=1))
    repo = Path(__file__).resolve().parents[1]
    cmd = [env.python, "-m", "services.verifiers_driver", str(path)]
    out = open(logs / "verifiers.log", "ab")  # noqa: SIM115 (lives as long as the process)
    extra = {"PYTHONPATH": str(repo)}  # its driver, from this checkout; it holds none of the mesh's tokens
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**environment_of(frozenset()), **extra})
    return Supervised("verifiers", proc, logs / "verifiers.log", env=extra, roles=frozenset())


def agent_key(run_dir: Path, mesh: Mesh) -> Path:
    """A gateway key for this run's agents (never the mesh token): its hash in
    ``RUN_DIR/gateway_keys.json``, the key in ``RUN_DIR/agent.key`` (readable by this user only)."""
    from services.gateway.keys import issue_key

    key = issue_key(run_dir / "gateway_keys.json", "agent")
    path = run_dir / "agent.key"
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(key + "\n")
    mesh.agent_key = str(path)
    return run_dir / "gateway_keys.json"


def start_trainer(
    config_path: Path, overrides: list[str], mesh: Mesh, log_path: Path, procs: int = 1, gpus: str | None = None
):
    """The trainer process (on the mesh's services host); with ``procs`` > 1, ``procs`` ranks under
    torchrun (rank 0 serves /metrics); ``gpus``: its ``CUDA_VISIBLE_DEVICES``."""
    host = mesh.hosts.services
    port = f"train_loop.metrics_port={mesh.metrics_port('trainer', host)}"
    where = [f"train_loop.{o}" for o in host.bind("metrics_host")]
    cmd = serve_command("trainer", "trainer", [*overrides, *mesh.wiring, port, *where], str(config_path))
    if procs > 1:  # python -m torch.distributed.run ... -m launch.cli serve trainer ...
        cmd = [cmd[0], "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs), *cmd[1:]]
    return subprocess.Popen(
        host.command(cmd, cuda_env(gpus)),
        stdout=open(log_path, "ab"),  # noqa: SIM115 (closed with the process)
        stderr=subprocess.STDOUT,
        env=dict(os.environ, **cuda_env(gpus)),  # both tokens: it reads the buffer and updates weights
    )
