"""A run directory (``train_loop.run_dir``) as `rollmesh run` keeps it: resume or start over, the
metrics the trainer appends, the reward curve and the summary `rollmesh compare` reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rich.console import Console

from launch.compare import SUMMARY
from services.metrics_log import LOST_STEPS, continue_from

METRICS = "metrics.jsonl"
HELDOUT = "heldout.jsonl"  # each held-out score of the run (launch/run.py: HeldOutLog)


def prepare(run_dir: Path, fresh: bool, console: Console) -> Path | None:
    """Start over (``fresh``) or resume; returns the checkpoint resumed from (None: a new run).

    A run directory without a complete checkpoint holds nothing to resume: its old metrics and
    controller state go, so every service starts at version 0. A resumed run's curve goes on from
    the checkpoint: lines of steps trained after it (and lost with the process) move aside.
    """
    from launch.config import CONTROLLER_STATE
    from trainer.durable import latest_checkpoint  # (trainer.checkpoint imports torch: seconds)

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if fresh:
        for sub in ("checkpoints", "weights"):
            shutil.rmtree(run_dir / sub, ignore_errors=True)
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    metrics = run_dir / METRICS
    if ckpt is None:
        for stale in (metrics, run_dir / LOST_STEPS, run_dir / CONTROLLER_STATE, run_dir / HELDOUT):
            stale.unlink(missing_ok=True)
        return None
    console.print(f"[yellow]resuming from {ckpt}[/] (pass --fresh to start over)")
    continue_from(metrics, int(ckpt.name.removeprefix("step_")))
    return ckpt


def tail_metrics(run_dir: Path, seen: int) -> tuple[list[dict], int]:
    """Lines after the first ``seen`` and the new count. A restarted trainer moves the steps it lost
    out of the file (``continue_from``): then it is read again from where it now ends."""
    path = run_dir / METRICS
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


def write_summary(run_dir: Path, summary: dict) -> None:
    (run_dir / SUMMARY).write_text(json.dumps(summary) + "\n")  # what `rollmesh compare` reads
