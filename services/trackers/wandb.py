"""Weights & Biases (``train_loop.tracking.wandb_project``); offline mode writes the run under the run
directory to ``wandb sync`` later."""

from __future__ import annotations

from pathlib import Path

from services.trackers import require


class WandB:
    def __init__(self, project: str, mode: str, run_name: str, run_dir: Path) -> None:
        self.wandb = require("wandb")
        self.run = self.wandb.init(project=project, name=run_name, mode=mode, dir=str(run_dir), resume="allow")

    def log(self, numbers: dict[str, float], step: int) -> None:
        self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() can return before wandb's service process has written the run file (an
        # offline run was sometimes still empty when the trainer exited); teardown waits for it.
        self.wandb.teardown()
