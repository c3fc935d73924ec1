"""`rollmesh launch slurm CONFIG`: the mesh as one SLURM batch job, each service a job step.

Submitting (``submit``) writes ``RUN_DIR/slurm/job.sh`` and ``RUN_DIR/slurm/tokens.env`` (mode 600, in
a mode-700 folder: the run's data and control tokens, never on a command line nor in the script) and
runs ``sbatch``. The job runs ``rollmesh run CONFIG --launcher slurm`` on its first node, which starts
every service as ``srun --overlap --nodelist NODE ...`` (``Hosts`` of ``allocation_hosts``) and then
does what `rollmesh run` does: waits for health, evaluates, trains, restarts a step that exits (up to
``run.max_restarts``, then the job fails with the service's log named), and stops every step at the
end. ``scancel`` sends SIGTERM to the batch step: the run stops its steps and exits.

Layout: with ``slurm.engine_nodes`` 0 every process runs on the one node (GPUs as ``devices`` maps
them, as `rollmesh run` does); with N > 0 the engines are spread over nodes 2..N+1, each taking its
node's GPUs in turn, and the first node keeps the other services and the trainer. Each service
binds the address Slurm has for its node (``NodeAddr``): the run directory must be on a file system
every node mounts (checkpoints, exported weights, logs).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from launch.mesh import Hosts
from services.auth import CONTROL_TOKEN_ENV, TOKEN_ENV, ensure_token, environment_of
from services.processes import Host

SCONTROL_TIMEOUT_S = 30.0  # a controller that does not answer is an error, not a hang


class SlurmError(RuntimeError):
    """Slurm refused or is missing: the message says what and where."""


def check_gpus(cfg) -> None:
    """Refuse before submitting a job that could not place the config's GPUs (``ValueError`` naming the field)."""
    slurm, need_head = cfg.slurm, 0
    if cfg.devices.placement != "none":
        need_head = len(set(cfg.devices.trainer_gpus) | (set() if slurm.engine_nodes else set(cfg.devices.engine_gpus)))
    if need_head > slurm.gpus_per_node:
        raise ValueError(
            f"slurm.gpus_per_node: {slurm.gpus_per_node}, but devices places {need_head} GPU(s) on the first node"
        )
    if slurm.engine_nodes:
        per_node = -(-cfg.run.num_engines // slurm.engine_nodes) * _gpus_per_engine(cfg)
        if slurm.gpus_per_node and per_node > slurm.gpus_per_node:
            raise ValueError(
                f"slurm.gpus_per_node: {slurm.gpus_per_node}, but each engine node runs engines of {per_node} GPU(s) "
                f"(run.num_engines={cfg.run.num_engines} over slurm.engine_nodes={slurm.engine_nodes})"
            )
        if cfg.run.num_engines < slurm.engine_nodes:
            raise ValueError(
                f"slurm.engine_nodes: {slurm.engine_nodes} nodes for run.num_engines={cfg.run.num_engines} engines"
            )


def check_transport(cfg) -> None:
    """A collective weight group meets at one address, which engines on other nodes would have to
    reach: not wired up across nodes yet (disk and http_buckets are)."""
    if cfg.slurm.engine_nodes and "master_address" in type(cfg.train_loop.publisher).model_fields:
        raise ValueError(
            f"train_loop.publisher: {cfg.train_loop.publisher.type} across nodes (slurm.engine_nodes="
            f"{cfg.slurm.engine_nodes}) is not supported yet; use disk or http_buckets"
        )


def _gpus_per_engine(cfg) -> int:
    from launch.device_map import gpus_per_engine

    return gpus_per_engine(cfg.engine)


def job_script(cfg, config_path: Path, overrides: list[str], folder: Path) -> str:
    """The batch script: ``#SBATCH`` options from ``cfg.slurm``, the tokens read from ``tokens.env``,
    then ``rollmesh run --launcher slurm`` with this interpreter and working directory. Never
    ``--fresh``: a job Slurm requeues (a node lost, preemption) resumes from its last checkpoint."""
    slurm = cfg.slurm
    opts = [f"--job-name={slurm.job_name}", f"--nodes={1 + slurm.engine_nodes}", "--ntasks-per-node=1"]
    opts += ["--exclusive", f"--output={folder / 'job-%j.out'}", "--open-mode=append"]
    opts += [f"--partition={slurm.partition}"] if slurm.partition else []
    opts += [f"--time={slurm.time_limit}"] if slurm.time_limit else []
    opts += [f"--gres=gpu:{slurm.gpus_per_node}"] if slurm.gpus_per_node else []
    opts += slurm.sbatch_args
    run = [sys.executable, "-m", "launch.cli", "run", str(config_path.resolve()), "--launcher", "slurm"]
    for o in overrides:
        run += ["--set", o]
    lines = ["#!/bin/bash", *(f"#SBATCH {shlex.quote(o)}" for o in opts)]
    lines += [
        "# written by `rollmesh launch slurm`; the tokens come from a file only this user reads",
        "set -euo pipefail",
        f"cd {shlex.quote(os.getcwd())}",
        f"set -a; . {shlex.quote(str(folder / 'tokens.env'))}; set +a",
        "exec " + " ".join(shlex.quote(a) for a in run),
    ]
    return "\n".join(lines) + "\n"


def write_tokens(cfg, folder: Path) -> Path:
    """The run's tokens (this shell's ``ROLLMESH_*TOKEN``, else fresh ones) in ``folder/tokens.env``, mode 600."""
    auth = ensure_token(cfg.auth)
    path = folder / "tokens.env"
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        if not auth.disabled:
            for name, secret in ((TOKEN_ENV, auth.token), (CONTROL_TOKEN_ENV, auth.control_token)):
                f.write(f"{name}={shlex.quote(secret.get_secret_value())}\n")
    return path


def submit(
    cfg, config_path: Path, overrides: list[str], fresh: bool = False, dry_run: bool = False
) -> tuple[str, Path]:
    """Write the job and submit it; returns (job id, script). ``dry_run``: write only (job id "")."""
    check_gpus(cfg)
    check_transport(cfg)
    run_dir = Path(cfg.train_loop.run_dir).resolve()
    folder = run_dir / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    write_tokens(cfg, folder)
    script = folder / "job.sh"
    script.write_text(job_script(cfg, config_path, overrides, folder))
    if dry_run:
        return "", script
    if fresh:  # here, once: not in the script a requeued job runs again
        for sub in ("checkpoints", "weights"):
            shutil.rmtree(run_dir / sub, ignore_errors=True)
    try:  # sbatch hands its environment to the job, and Slurm stores it: no token in it
        done = subprocess.run(
            ["sbatch", "--parsable", str(script)],
            capture_output=True,
            text=True,
            timeout=cfg.slurm.submit_timeout_s,
            env=environment_of(frozenset()),
        )
    except FileNotFoundError:
        raise SlurmError(
            "sbatch is not installed here: run `rollmesh launch slurm` on a login node of the cluster"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(
            f"sbatch did not answer within slurm.submit_timeout_s={cfg.slurm.submit_timeout_s:g}s"
        ) from None
    if done.returncode != 0:
        slurm = cfg.slurm
        asked = f"--nodes={1 + slurm.engine_nodes} (slurm.engine_nodes + 1)"
        asked += f", --gres=gpu:{slurm.gpus_per_node} (slurm.gpus_per_node)" if slurm.gpus_per_node else ""
        asked += f", --partition={slurm.partition} (slurm.partition)" if slurm.partition else ""
        why = done.stderr.strip() or done.stdout.strip()
        raise SlurmError(f"sbatch refused {script}, which asks for {asked}: {why}")
    return done.stdout.strip().split(";")[0], script


def _scontrol(*args: str) -> str:
    try:
        done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except FileNotFoundError:
        raise SlurmError("scontrol is not installed here: --launcher slurm runs on a node of a SLURM job") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"scontrol {' '.join(args)}: no answer within {SCONTROL_TIMEOUT_S:g}s") from None
    if done.returncode != 0:
        raise SlurmError(f"scontrol {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def node_address(node: str) -> str:
    """The address Slurm reaches ``node`` at (its ``NodeAddr``), which the other nodes dial too."""
    for field in _scontrol("show", "node", "--oneliner", node).split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1]
    raise SlurmError(f"scontrol show node {node}: no NodeAddr")


def step(node: str, service: str) -> Host:
    """A service as a job step on ``node``: one task sharing the node's CPUs and memory with the
    other steps (``--overlap``: the mesh's services run side by side), its output to the caller's log."""
    wrap = ("srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}", f"--job-name={service}")
    return Host(
        node_address(node),
        (*wrap, "--cpus-per-task=" + os.environ.get("SLURM_CPUS_ON_NODE", "1"), "--mem=0", "--quiet"),
    )


def engine_node_gpus(i: int, engine_nodes: int, gpus_per_engine: int, gpus_per_node: int) -> str | None:
    """Engine ``i``'s ``CUDA_VISIBLE_DEVICES`` on its own node (engines go round the engine nodes, and
    each takes the next ``gpus_per_engine`` GPUs of its node); None on nodes without GPUs."""
    if not gpus_per_node:
        return None
    first = (i // engine_nodes) * gpus_per_engine
    return ",".join(str(g) for g in range(first, first + gpus_per_engine))


def allocation_hosts(cfg, placement) -> Hosts:
    """Where each process runs in this allocation (``SLURM_JOB_NODELIST``), see the module's layout;
    with engine nodes, ``placement``'s engines take their nodes' GPUs (``engine_node_gpus``)."""
    if "SLURM_JOB_ID" not in os.environ:
        raise SlurmError(
            "--launcher slurm runs inside a SLURM job (SLURM_JOB_ID is not set): "
            "submit with `rollmesh launch slurm CONFIG`"
        )
    nodes = _scontrol("show", "hostnames", os.environ["SLURM_JOB_NODELIST"]).split()
    need = 1 + cfg.slurm.engine_nodes
    if len(nodes) < need:
        raise SlurmError(
            f"slurm.engine_nodes: {cfg.slurm.engine_nodes} engine nodes and the first need {need} nodes; "
            f"the job has {len(nodes)} ({', '.join(nodes)})"
        )
    head = step(nodes[0], "rollmesh")
    engines = [step(n, "engine") for n in nodes[1:need]]
    if engines:
        gpe, per_node = _gpus_per_engine(cfg), cfg.slurm.gpus_per_node
        placement.engines = [engine_node_gpus(i, len(engines), gpe, per_node) for i in range(cfg.run.num_engines)]
    return Hosts(services=head, engines=engines)
