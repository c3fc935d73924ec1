"""`rollmesh run CONFIG`, from the command line to the end of the run; read top to bottom.

1. Load the config; check the credentials and files it names (`launch/preflight.py`); place
   engines and trainer on GPUs; make the run's token; share the cores.
2. Prepare the run directory (resume from its last checkpoint, or start over).
3. Start the mesh (`launch/mesh.py`), the EnvManager holding its workers back.
4. Measure the policy on held-out prompts, then let rollouts begin (EnvManager `Start`).
5. Start the trainer; supervise every process (restart what dies) and print progress.
6. When the trainer has trained every step: stop the rollouts (`Stop`), measure again, write
   the summary and the reward curve, stop the mesh.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

from prometheus_client import CollectorRegistry
from rich.console import Console

from launch import preflight, slurm
from launch import run_dir as rundir
from launch.config import load_config
from launch.cpu_threads import thread_overrides, usable_cores
from launch.device_map import gpus_per_engine, place, visible_gpus
from launch.evaluation import evaluator
from launch.mesh import Hosts, Mesh, cuda_env, start_mesh, start_trainer
from launch.run_progress import RunProgress
from launch.supervisor import GaveUp, RestartsCollector, Supervised
from services.auth import ensure_token
from services.env_manager.client import EnvManagerClient
from services.metrics import serve_metrics
from services.processes import StartupError, stop_process


def run_mesh(config_path: Path, overrides: list[str], fresh: bool = False, launcher: str = "local") -> int:
    """``launcher`` local: every process here on loopback; slurm: job steps of this SLURM job
    (``launch/slurm.py``, which `rollmesh launch slurm` submits)."""
    cfg = load_config(config_path, overrides)
    console = Console(soft_wrap=True)  # a log file gets whole lines, not lines wrapped at 80 columns
    try:  # before anything starts: a GPU the map names must be here, and the nodes the job needs
        visible = visible_gpus() if cfg.devices.placement != "none" else []
        placement = place(cfg.devices, cfg.run.num_engines, gpus_per_engine(cfg.engine), cfg.run.trainer_procs, visible)
        hosts = Hosts() if launcher == "local" else slurm.allocation_hosts(cfg, placement)
    except (ValueError, slurm.SlurmError) as e:
        console.print(f"[red]config error: {e}[/]")
        return 2
    if missing := preflight.problems(cfg):  # credentials and files, before any process starts
        for line in missing:
            console.print(f"config error: {line}", style="red", markup=False, highlight=False)
        return 2
    ensure_token(cfg.auth)  # one per run, inherited by every process started below
    threads, line = thread_overrides(cfg, usable_cores())
    if line:
        console.print(line)
    overrides = [*overrides, *threads]
    signal.signal(signal.SIGTERM, _interrupt)
    run_dir = Path(cfg.train_loop.run_dir)
    resumed = rundir.prepare(run_dir, fresh, console) is not None
    logs = run_dir / "logs"
    mesh: Mesh | None = None
    trainer: Supervised | None = None
    t0 = time.time()
    try:
        mesh = start_mesh(cfg, config_path, overrides, logs, placement, hold_rollouts=True, hosts=hosts)
        cfg.mesh.reward = mesh.reward or cfg.mesh.reward  # the held-out evaluation scores there too
        _announce(mesh, console)
        heldout = HeldOutLog(evaluator(cfg), mesh.proxy, cfg, run_dir, console)
        # when resuming: the restored weights, as the engines now serve them
        before = heldout.now("at resume" if resumed else "before training")
        if mesh.env_manager:
            asyncio.run(_start_rollouts(mesh, cfg))
        earlier, seen = rundir.tail_metrics(run_dir, 0)  # earlier runs' lines, when resuming
        proc = start_trainer(
            config_path, overrides, mesh, logs / "trainer.log", placement.trainer_procs, placement.trainer
        )
        trainer = Supervised("trainer", proc, logs / "trainer.log", finishes=True, env=cuda_env(placement.trainer))
        _supervise(cfg, mesh, trainer, console, run_dir, seen, earlier[-1]["step"] if earlier else 0, heldout)
        rollouts = _stop_rollouts(mesh, cfg, console) if mesh.env_manager else None
        after = heldout.now("after training")
        _finish(cfg, run_dir, console, before if not resumed else None, after, rollouts, time.time() - t0)
        return 0
    except GaveUp as e:
        console.print(f"[red]{e}[/]")
        return 1
    except StartupError as e:  # its own last lines and log, not this launcher's traceback
        console.print(str(e), style="red", markup=False, highlight=False)
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping the mesh[/]")
        return 130
    finally:
        if trainer is not None:
            stop_process(trainer.proc)
        if mesh is not None:
            mesh.stop()


def _interrupt(signum, frame):  # stop the mesh on SIGTERM as on Ctrl-C, never leave orphans
    raise KeyboardInterrupt


def _announce(mesh: Mesh, console: Console) -> None:
    console.print(f"[green]engines[/] {', '.join(mesh.engine_urls) or 'shared, behind the LLMProxy'}")
    console.print(f"[green]mesh up[/] proxy {mesh.proxy}, buffer {mesh.buffer}, controller {mesh.controller}")
    if mesh.gateway:
        key = f"the key in {mesh.agent_key}" if mesh.agent_key else "a key of gateway.api_keys_path"
        console.print(f"[green]agent gateway[/] {mesh.gateway}/v1 ({key}); waiting for agents")


async def _start_rollouts(mesh: Mesh, cfg) -> None:
    client = EnvManagerClient(mesh.env_manager, auth=cfg.auth)
    try:
        await client.start()
    finally:
        await client.close()


async def _stopped_rollouts(mesh: Mesh, cfg) -> dict:
    """The workers stopped (the groups in flight are abandoned: training is over), so that the final
    evaluation has the engines to itself; what they did."""
    client = EnvManagerClient(mesh.env_manager, auth=cfg.auth)
    try:
        abandoned = await client.stop(drain=False)
        return {**await client.stats(), "episodes_abandoned": abandoned}
    finally:
        await client.close()


def _stop_rollouts(mesh: Mesh, cfg, console: Console) -> dict | None:
    """Training is done, so a failure here (the EnvManager restarting at that moment) is reported
    and the run still ends with its summary."""
    try:
        return asyncio.run(_stopped_rollouts(mesh, cfg))
    except Exception as e:  # a gRPC failure of any kind: the summary says "rollouts": null
        console.print(f"[yellow]could not stop the EnvManager's workers: {type(e).__name__}: {e}[/]")
        return None


class HeldOutLog:
    """The run's held-out scores: before and after training, and every ``run.eval_every`` steps in
    between (while the trainer goes on; the launcher scores in its main thread, where math-verify's
    time limits work); printed, and a line each in RUN_DIR/heldout.jsonl."""

    def __init__(self, evaluate, proxy: str, cfg, run_dir: Path, console: Console) -> None:
        self.evaluate, self.proxy, self.cfg, self.console = evaluate, proxy, cfg, console
        self.path = run_dir / rundir.HELDOUT

    def now(self, when: str, step: int | None = None):
        """Score now; None for a run without a held-out set."""
        if self.evaluate is None:
            return None
        result = asyncio.run(self.evaluate(self.proxy, self.cfg))
        self.console.print(f"held-out accuracy {when}: {result}")
        line = {"when": when, "step": step, "accuracy": result.accuracy, "unanswered": result.unanswered}
        with open(self.path, "a") as f:
            f.write(json.dumps(line | _by_domain("by_domain", result)) + "\n")
        return result

    def step(self, step: int) -> None:
        """After each step line: a score when one is due (the last step's is the one after training)."""
        every, last = self.cfg.run.eval_every, self.cfg.train_loop.steps
        if every and step % every == 0 and step < last:
            self.now(f"at step {step}", step)


def _supervise(
    cfg, mesh: Mesh, trainer: Supervised, console: Console, run_dir: Path, seen: int, step0: int, heldout: HeldOutLog
) -> None:
    """Until the trainer exits 0 (every step trained): restart what dies, print each step."""
    supervised = [*mesh.services, trainer]
    registry = CollectorRegistry()
    registry.register(RestartsCollector(supervised))
    host = mesh.hosts.services  # (under SLURM: the first node's address, where Prometheus reaches it)
    serve_metrics(registry, host.address, int(mesh.metrics_port("launcher", host)), "rollmesh run")
    mesh.write_scrape_targets(run_dir / "prometheus_targets.json")
    console.print(f"metrics: Prometheus file_sd targets in {run_dir / 'prometheus_targets.json'}")
    progress = RunProgress(console, cfg.train_loop.steps, step0)
    try:
        while trainer.proc.poll() != 0:
            time.sleep(1.0)
            for s in supervised:  # a service that died comes back (a trainer resumes from its checkpoint)
                s.check(cfg.run.max_restarts, lambda line: console.print(f"[red]{line}[/]"))
            new, seen = rundir.tail_metrics(run_dir, seen)
            for m in new:
                progress.step(m)
                heldout.step(m["step"])
    finally:
        progress.close()


def _by_domain(key: str, result) -> dict:
    by_domain = getattr(result, "by_domain", None)
    return {key: {d: h.accuracy for d, h in by_domain.items()}} if by_domain else {}


def _finish(cfg, run_dir: Path, console: Console, before, after, rollouts: dict | None, wall_s: float) -> None:
    """The summary file, the final line (which tests and scripts parse) and the reward curve."""
    history, _ = rundir.tail_metrics(run_dir, 0)  # the curve as it stands, resumes included
    curve = run_dir / "reward_curve.png"
    if history:
        rundir.plot_rewards(history, curve)
    if after is not None and (after.unanswered or after.scoring_faults):
        console.print(f"[red]held-out: {after}[/]")
    if rollouts is not None:
        failures = ", ".join(f"{k} {v}" for k, v in rollouts["failures_by_reason"].items()) or "none"
        console.print(f"rollouts: {rollouts['groups_put']} groups put, failures: {failures}")
    last5 = [m["reward_mean"] for m in history[-5:]]
    reward_last5 = sum(last5) / max(1, len(last5))
    steps = history[-1]["step"] if history else 0
    summary = {
        "steps": steps,
        "reward_mean_last5": round(reward_last5, 4),
        "heldout_before": None if before is None else before.accuracy,
        "heldout_after": None if after is None else after.accuracy,
        **_by_domain("heldout_by_domain_before", before),
        **_by_domain("heldout_by_domain_after", after),
        "wall_s": round(wall_s, 1),
        "async_ratio": cfg.controller.async_ratio,
        "rollouts": rollouts,  # the EnvManager's Stats: groups put, failures by reason
    }
    rundir.write_summary(run_dir, summary)
    acc = after.accuracy if after is not None else float("nan")
    print(
        f"final: steps={steps} reward_mean_last5={reward_last5:.3f} heldout_accuracy={acc:.3f} "
        f"wall_s={summary['wall_s']:.1f}",
        flush=True,
    )
    if history:
        print(f"reward curve: {curve}  metrics: {run_dir / 'metrics.jsonl'}", flush=True)
