"""`rollmesh run`: every service as its own local process on loopback, progress, evaluation.

Order: engines → LLMProxy → SampleBuffer → AsyncController → (reward service) → EnvManager →
trainer. Each is waited on for health before the next starts; all of them are stopped (SIGTERM,
then SIGKILL) at the end or on Ctrl-C. Logs go to ``RUN_DIR/logs/<service>.log``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry
from rich.console import Console

from services.auth import ensure_token
from services.compare import SUMMARY
from services.config import load_config
from services.cpu_threads import thread_overrides, usable_cores
from services.device_map import Placement, gpus_per_engine, place, visible_gpus
from services.evaluation import evaluator
from services.launch import (
    free_port,
    serve_command,
    start_engine_process,
    start_gateway_process,
    start_service_process,
    stop_process,
)
from services.metrics import serve_metrics
from services.metrics_log import LOST_STEPS, continue_from
from services.run_progress import RunProgress
from services.supervisor import GaveUp, RestartsCollector, Supervised


def _tail_metrics(path: Path, seen: int) -> tuple[list[dict], int]:
    """Lines after the first ``seen`` and the new count. A restarted trainer moves the steps it lost
    out of the file (``continue_from``): then it is read again from where it now ends."""
    if not path.exists():
        return [], seen
    lines = path.read_text().splitlines()
    if len(lines) < seen:
        return [], len(lines)
    return [json.loads(x) for x in lines[seen:] if x.endswith("}")], len(lines)


def plot_rewards(metrics: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m["step"] for m in metrics], [m["reward_mean"] for m in metrics])
    ax.set_xlabel("step")
    ax.set_ylabel("reward mean")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def _prepare_run_dir(run_dir: Path, fresh: bool, console: Console) -> Path | None:
    """Start over (``fresh``) or resume; returns the checkpoint resumed from (None: a new run).

    A run directory without a complete checkpoint holds nothing to resume: its old metrics and
    controller state go, so every service starts at version 0. A resumed run's curve goes on from
    the checkpoint: lines of steps trained after it (and lost with the process) move aside.
    """
    from services.config import CONTROLLER_STATE
    from trainer.checkpoint import latest_checkpoint

    if fresh:
        for sub in ("checkpoints", "weights"):
            shutil.rmtree(run_dir / sub, ignore_errors=True)
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    metrics = run_dir / "metrics.jsonl"
    if ckpt is None:
        for stale in (metrics, run_dir / LOST_STEPS, run_dir / CONTROLLER_STATE):
            stale.unlink(missing_ok=True)
        return None
    console.print(f"[yellow]resuming from {ckpt}[/] (pass --fresh to start over)")
    continue_from(metrics, int(ckpt.name.removeprefix("step_")))
    return ckpt


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

    def metrics_port(self, job: str) -> str:
        """A free loopback port for ``job``'s /metrics, recorded as a scrape target."""
        port = free_port()
        self.metrics.setdefault(job, []).append(f"127.0.0.1:{port}")
        return str(port)

    def write_scrape_targets(self, path: Path) -> None:
        """Prometheus file_sd targets of this mesh (what `deploy/prometheus` scrapes in a cluster)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([{"targets": t, "labels": {"job": job}} for job, t in self.metrics.items()]))

    @property
    def wiring(self) -> list[str]:
        """``--set`` overrides that point a client (EnvManager, trainer) at this mesh."""
        wiring = [f"mesh.proxy={self.proxy}", f"mesh.buffer={self.buffer}", f"mesh.controller={self.controller}"]
        return wiring + ([f"mesh.reward={self.reward}"] if self.reward else [])

    def stop(self) -> None:
        for s in reversed(self.services):
            stop_process(s.proc)


def _gpus(name: str | None) -> dict[str, str]:
    return {} if name is None else {"CUDA_VISIBLE_DEVICES": name}


def needs_reward_service(cfg) -> bool:
    """The task's reward is the mesh's reward service (``{type: service}``, no address of its own): the
    EnvManager's episodes and the held-out evaluation score there."""
    reward = cfg.env_manager.reward
    return not isinstance(reward, str) and reward.type == "service" and reward.address is None


def start_mesh(cfg, config_path: Path, overrides: list[str], logs: Path, placement: Placement | None = None) -> Mesh:
    """Engines → LLMProxy → SampleBuffer → AsyncController → (reward service) → EnvManager, each
    healthy before the next (engines on the GPUs ``placement`` gives them). On any failure
    everything started so far is stopped."""
    placement = placement or Placement([None] * cfg.run.num_engines, None, cfg.run.trainer_procs)
    mesh = Mesh([], [], "", "", "")
    up = dict(config_path=str(config_path), timeout_s=cfg.run.startup_timeout_s, auth=cfg.auth)
    try:

        def engine(i):
            return start_engine_process(
                cfg.engine.model_path,
                free_port(),
                overrides,
                cfg.run.startup_timeout_s,
                str(config_path),
                cfg.auth,
                _gpus(placement.engines[i]),
            )

        with ThreadPoolExecutor(cfg.run.num_engines) as pool:  # engines load in parallel
            futures = [pool.submit(engine, i) for i in range(cfg.run.num_engines)]
        started = [f.result() for f in futures if f.exception() is None]
        mesh.services += [
            Supervised(f"engine-{i}", p, logs / f"engine-{i}.log", env=_gpus(placement.engines[i]))
            for i, (p, _) in enumerate(started)
        ]
        mesh.engine_urls += [u for _, u in started]
        mesh.metrics["engine"] = [u.split("://", 1)[1] for u in mesh.engine_urls]  # /metrics beside the API
        for f in futures:
            if f.exception() is not None:
                raise f.exception()
        proc, mesh.proxy = start_service_process(
            "llm-proxy",
            "proxy",
            [
                *overrides,
                f"proxy.engine_urls=[{','.join(mesh.engine_urls)}]",
                f"proxy.metrics_port={mesh.metrics_port('llm-proxy')}",
            ],
            log_path=logs / "proxy.log",
            **up,
        )
        mesh.services.append(Supervised("llm-proxy", proc, logs / "proxy.log"))
        proc, mesh.buffer = start_service_process(
            "sample-buffer",
            "buffer",
            [*overrides, f"buffer.metrics_port={mesh.metrics_port('sample-buffer')}"],
            log_path=logs / "buffer.log",
            **up,
        )
        mesh.services.append(Supervised("sample-buffer", proc, logs / "buffer.log"))
        ctl = [
            *overrides,
            f"mesh.proxy={mesh.proxy}",
            f"mesh.buffer={mesh.buffer}",
            f"controller.metrics_port={mesh.metrics_port('controller')}",
        ]
        proc, mesh.controller = start_service_process(
            "controller", "controller", ctl, log_path=logs / "controller.log", **up
        )
        mesh.services.append(Supervised("controller", proc, logs / "controller.log"))
        if needs_reward_service(cfg):
            proc, mesh.reward = start_service_process(
                "reward",
                "reward_service",
                [*overrides, *mesh.wiring, f"reward_service.metrics_port={mesh.metrics_port('reward')}"],
                log_path=logs / "reward.log",
                **up,
            )
            mesh.services.append(Supervised("reward", proc, logs / "reward.log"))
        if cfg.run.rollout == "gateway":  # external agents make the rollouts
            proc, mesh.gateway = start_gateway_process(
                [*overrides, *mesh.wiring], cfg.gateway.port or free_port(), log_path=logs / "gateway.log", **up
            )
            mesh.metrics["gateway"] = [mesh.gateway.split("://", 1)[1]]  # /metrics beside the API
            mesh.services.append(Supervised("gateway", proc, logs / "gateway.log"))
        else:
            proc, _ = start_service_process(
                "env-manager",
                "env_manager",
                [*overrides, *mesh.wiring, f"env_manager.metrics_port={mesh.metrics_port('env-manager')}"],
                log_path=logs / "env_manager.log",
                **up,
            )
            mesh.services.append(Supervised("env-manager", proc, logs / "env_manager.log"))
    except BaseException:
        mesh.stop()
        raise
    return mesh


def start_trainer(
    config_path: Path, overrides: list[str], mesh: Mesh, log_path: Path, procs: int = 1, gpus: str | None = None
):
    """The trainer process; with ``procs`` > 1, ``procs`` ranks under torchrun (rank 0 serves /metrics);
    ``gpus``: its ``CUDA_VISIBLE_DEVICES``."""
    port = f"train_loop.metrics_port={mesh.metrics_port('trainer')}"
    cmd = serve_command("trainer", "trainer", [*overrides, *mesh.wiring, port], str(config_path))
    if procs > 1:  # python -m torch.distributed.run ... -m services.cli serve trainer ...
        cmd = [cmd[0], "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs), *cmd[1:]]
    return subprocess.Popen(
        cmd,
        stdout=open(log_path, "ab"),  # noqa: SIM115 (closed with the process)
        stderr=subprocess.STDOUT,
        env=dict(os.environ, **_gpus(gpus)),
    )


def run_mesh(config_path: Path, overrides: list[str], fresh: bool = False) -> int:
    cfg = load_config(config_path, overrides)
    console = Console(soft_wrap=True)  # a log file gets whole lines, not lines wrapped at 80 columns
    try:  # before anything starts: a GPU the map names must be here
        placement = place(
            cfg.devices,
            cfg.run.num_engines,
            gpus_per_engine(cfg.engine),
            cfg.run.trainer_procs,
            visible_gpus() if cfg.devices.placement != "none" else [],
        )
    except ValueError as e:
        console.print(f"[red]config error: {e}[/]")
        return 2
    ensure_token(cfg.auth)  # one per run, inherited by every process started below
    threads, line = thread_overrides(cfg, usable_cores())
    if line:
        console.print(line)
    overrides = [*overrides, *threads]

    def _on_sigterm(signum, frame):  # stop the mesh on SIGTERM as on Ctrl-C, never leave orphans
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_sigterm)
    run_dir = Path(cfg.train_loop.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    resumed = _prepare_run_dir(run_dir, fresh, console) is not None
    logs = run_dir / "logs"
    mesh: Mesh | None = None
    trainer: Supervised | None = None
    t0 = time.time()
    try:
        mesh = start_mesh(cfg, config_path, overrides, logs, placement)
        cfg.mesh.reward = mesh.reward or cfg.mesh.reward  # the held-out evaluation scores there too
        console.print(f"[green]engines[/] {', '.join(mesh.engine_urls)}")
        console.print(f"[green]mesh up[/] proxy {mesh.proxy}, buffer {mesh.buffer}, controller {mesh.controller}")
        if mesh.gateway:
            console.print(f"[green]agent gateway[/] {mesh.gateway}/v1 (key: $ROLLMESH_TOKEN); waiting for agents")
        proxy_addr = mesh.proxy
        acc0, evaluate = None, evaluator(cfg)
        if evaluate is not None:  # when resuming: the restored weights, as the engines now serve them
            acc0 = asyncio.run(evaluate(proxy_addr, cfg))
            console.print(f"held-out accuracy {'at resume' if resumed else 'before training'}: {acc0}")
        earlier, seen = _tail_metrics(run_dir / "metrics.jsonl", 0)  # earlier runs' lines, when resuming
        trainer_proc = start_trainer(
            config_path, overrides, mesh, logs / "trainer.log", placement.trainer_procs, placement.trainer
        )
        trainer = Supervised("trainer", trainer_proc, logs / "trainer.log", finishes=True, env=_gpus(placement.trainer))
        supervised = [*mesh.services, trainer]
        launcher_registry = CollectorRegistry()
        launcher_registry.register(RestartsCollector(supervised))
        serve_metrics(launcher_registry, "127.0.0.1", int(mesh.metrics_port("launcher")), "rollmesh run")
        mesh.write_scrape_targets(run_dir / "prometheus_targets.json")
        console.print(f"metrics: Prometheus file_sd targets in {run_dir / 'prometheus_targets.json'}")
        progress = RunProgress(console, cfg.train_loop.steps, earlier[-1]["step"] if earlier else 0)
        try:
            while trainer.proc.poll() != 0:  # the trainer exits 0 once it has trained every step
                time.sleep(1.0)
                for s in supervised:  # a service that died comes back (a trainer resumes from its checkpoint)
                    s.check(cfg.run.max_restarts, lambda line: console.print(f"[red]{line}[/]"))
                new, seen = _tail_metrics(run_dir / "metrics.jsonl", seen)
                for m in new:
                    progress.step(m)
        finally:
            progress.close()
        history, _ = _tail_metrics(run_dir / "metrics.jsonl", 0)  # the curve as it stands, resumes included
        curve = run_dir / "reward_curve.png"
        if history:
            plot_rewards(history, curve)
        held = asyncio.run(evaluate(proxy_addr, cfg)) if evaluate is not None else None
        if held is not None and (held.unanswered or held.scoring_faults):
            console.print(f"[red]held-out: {held}[/]")
        acc = held.accuracy if held is not None else float("nan")
        last5 = [m["reward_mean"] for m in history[-5:]]
        reward_last5 = sum(last5) / max(1, len(last5))
        steps = history[-1]["step"] if history else 0
        summary = {
            "steps": steps,
            "reward_mean_last5": round(reward_last5, 4),
            "heldout_before": None if acc0 is None or resumed else acc0.accuracy,
            "heldout_after": None if held is None else held.accuracy,
            "wall_s": round(time.time() - t0, 1),
            "async_ratio": cfg.controller.async_ratio,
        }
        (run_dir / SUMMARY).write_text(json.dumps(summary) + "\n")  # what `rollmesh compare` reads
        print(
            f"final: steps={steps} reward_mean_last5={reward_last5:.3f} heldout_accuracy={acc:.3f} "
            f"wall_s={summary['wall_s']:.1f}",
            flush=True,
        )
        if history:
            print(f"reward curve: {curve}  metrics: {run_dir / 'metrics.jsonl'}", flush=True)
        return 0
    except GaveUp as e:
        console.print(f"[red]{e}[/]")
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping the mesh[/]")
        return 130
    finally:
        if trainer is not None:
            stop_process(trainer.proc)
        if mesh is not None:
            mesh.stop()
