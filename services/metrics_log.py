"""Where a step's training metrics go: ``metrics.jsonl`` always, the trackers (``services/trackers/``:
TensorBoard, W&B, SwanLab) when asked."""

from __future__ import annotations

import json
import os
from pathlib import Path

from services.trackers import open_trackers
from services.trackers.config import TrackingConfig

LOST_STEPS = "lost_steps.jsonl"  # beside metrics.jsonl: steps a trainer trained but lost before a checkpoint


def _step_of(line: str) -> float:
    """The step of a metrics.jsonl line; a line cut short by a killed process counts as past any."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return float("inf")


def continue_from(path: Path, step: int) -> int:
    """Make ``path`` the curve of a run resumed at ``step``: lines of later steps (trained by a
    process that died before its next checkpoint, so their updates are gone) move to
    ``lost_steps.jsonl`` beside it, where they still say which groups those steps consumed.
    Returns how many lines moved."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    kept = [line for line in lines if _step_of(line) <= step]
    lost = [line for line in lines if _step_of(line) > step and line.startswith("{") and line.endswith("}")]
    if len(kept) == len(lines):
        return 0
    with open(path.with_name(LOST_STEPS), "a") as f:
        f.writelines(line + "\n" for line in lost)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)  # a reader sees the old file or the new one, never half of it
    return len(lines) - len(kept)


class MetricsLog:
    """Appends each step's metrics to ``path`` (one JSON object per line) and to the trackers."""

    def __init__(
        self,
        path: Path,
        tracking: TrackingConfig | None = None,
        run_name: str = "rollmesh",
        run_dir: Path | None = None,
    ) -> None:
        self.path = path
        self.trackers = open_trackers(tracking or TrackingConfig(), run_name, run_dir or path.parent)

    def write(self, metrics: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and k != "step"}
        for tracker in self.trackers:
            tracker.log(numbers, int(metrics["step"]))

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
