"""`rollmesh compare RUN_DIR...`: runs side by side, reward against steps and against wall time.

Each run directory holds ``metrics.jsonl`` (one line per trained step, ``wall`` in epoch seconds)
and, once `rollmesh run` has finished, ``summary.json`` (held-out accuracy before and after, the
run's wall time). Wall time is counted from the end of step 1, so start-up and the first held-out
evaluation (the same for every run of one config) do not shift the curves.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

SUMMARY = "summary.json"


class RunMissing(ValueError):
    """A directory that holds no run to compare."""


def load_run(run_dir: Path) -> tuple[list[dict], dict]:
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.exists():
        raise RunMissing(f"{run_dir}: no metrics.jsonl (not a run directory, or no step trained yet)")
    metrics = [json.loads(x) for x in metrics_file.read_text().splitlines() if x.endswith("}")]
    if not metrics:
        raise RunMissing(f"{metrics_file}: no complete step")
    summary_file = run_dir / SUMMARY
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    return metrics, summary


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values: a 32-sample step's reward is too noisy to read alone."""
    return [statistics.mean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def run_row(metrics: list[dict], summary: dict, windows: int = 4) -> dict:
    rewards = [m["reward_mean"] for m in metrics]
    size = max(1, -(-len(rewards) // windows))  # ceil: every step falls in one window
    return {
        "steps": metrics[-1]["step"],
        "reward_by_window": [round(statistics.mean(rewards[i : i + size]), 3) for i in range(0, len(rewards), size)],
        "window_steps": size,
        "staleness_mean": round(statistics.mean(m["staleness_mean"] for m in metrics), 2),
        "train_wall_s": round(metrics[-1]["wall"] - metrics[0]["wall"], 1),  # step 1's end to the last step's
        # where a step's time goes: training, and waiting on the buffer for fresh-enough groups
        "train_s_per_step": _mean_of(metrics, "time_train_s"),
        "wait_s_per_step": _mean_of(metrics, "time_get_s"),
        "wall_s": summary.get("wall_s"),
        "heldout_before": summary.get("heldout_before"),
        "heldout_after": summary.get("heldout_after"),
    }


def _mean_of(metrics: list[dict], key: str) -> float | None:
    return round(statistics.mean(m[key] for m in metrics), 2) if all(key in m for m in metrics) else None


def compare(run_dirs: list[Path], out: Path | None = None, window: int = 5) -> dict:
    runs = {str(d): load_run(d) for d in run_dirs}
    if out is not None:
        _plot(runs, out, window)
    return {name: run_row(metrics, summary) for name, (metrics, summary) in runs.items()}


def _plot(runs: dict[str, tuple[list[dict], dict]], out: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_wall) = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    for name, (metrics, _) in runs.items():
        curve = smooth([m["reward_mean"] for m in metrics], window)
        by_step.plot([m["step"] for m in metrics], curve, label=name, linewidth=1.2)
        by_wall.plot([m["wall"] - metrics[0]["wall"] for m in metrics], curve, label=name, linewidth=1.2)
    by_step.set_xlabel("step")
    by_wall.set_xlabel("wall seconds after step 1")
    by_step.set_ylabel(f"reward mean ({window}-step trailing mean)")
    for ax in (by_step, by_wall):
        ax.grid(alpha=0.3)
    by_wall.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
