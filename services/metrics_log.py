"""Where a step's training metrics go: ``metrics.jsonl`` always, TensorBoard and W&B when asked.

TensorBoard and Weights & Biases are optional dependencies (``pip install 'rollmesh[track]'``);
asking for one that is not installed fails at start-up with the install command, not mid-run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TrackingConfig(BaseModel):
    """Experiment trackers the trainer also writes its metrics to."""

    model_config = ConfigDict(extra="forbid")

    tensorboard_dir: str | None = Field(None, description="Write TensorBoard event files here (needs tensorboard).")
    wandb_project: str | None = Field(None, description="Log to this Weights & Biases project (needs wandb).")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="offline writes the run under run_dir/wandb to `wandb sync` later (no network)."
    )


def _require(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise RuntimeError(
            f"{module} is not installed but the config asks for it: pip install 'rollmesh[track]'"
        ) from None


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
        tracking = tracking or TrackingConfig()
        self._tb = self._wandb = None
        if tracking.tensorboard_dir:
            _require("tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(tracking.tensorboard_dir)
        if tracking.wandb_project:
            wandb = _require("wandb")
            self._wandb = wandb.init(
                project=tracking.wandb_project,
                name=run_name,
                mode=tracking.wandb_mode,
                dir=str(run_dir or path.parent),
                resume="allow",
            )

    def write(self, metrics: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and k != "step"}
        step = int(metrics["step"])
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            # finish() can return before wandb's service process has written the run file (an
            # offline run was sometimes still empty when the trainer exited); teardown waits for it.
            _require("wandb").teardown()
