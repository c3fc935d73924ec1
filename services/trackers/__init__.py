"""Experiment trackers the trainer also writes each step's numbers to, besides ``metrics.jsonl``.

One module per tracker; adding one is a module with a ``Tracker`` and one line in ``TRACKERS``.
Each is an optional dependency: asking for one that is not installed fails at start-up with the
install command, not mid-run.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from services.trackers.config import TrackingConfig


class Tracker(Protocol):
    def log(self, numbers: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def require(module: str, install: str = "pip install 'rollmesh[track]'"):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise RuntimeError(f"{module} is not installed but the config asks for it: {install}") from None


def _tensorboard(tracking: TrackingConfig, run_name: str, run_dir: Path) -> Tracker | None:
    from services.trackers.tensorboard import TensorBoard

    return TensorBoard(tracking.tensorboard_dir) if tracking.tensorboard_dir else None


def _wandb(tracking: TrackingConfig, run_name: str, run_dir: Path) -> Tracker | None:
    from services.trackers.wandb import WandB

    return WandB(tracking.wandb_project, tracking.wandb_mode, run_name, run_dir) if tracking.wandb_project else None


def _swanlab(tracking: TrackingConfig, run_name: str, run_dir: Path) -> Tracker | None:
    from services.trackers.swanlab import SwanLab

    if not tracking.swanlab_project:
        return None
    return SwanLab(tracking.swanlab_project, tracking.swanlab_mode, run_name, run_dir)


# Each: the run's tracking config, its name and directory -> a tracker, or None when not asked for.
TRACKERS: dict[str, Callable[[TrackingConfig, str, Path], Tracker | None]] = {
    "tensorboard": _tensorboard,
    "wandb": _wandb,
    "swanlab": _swanlab,
}


def open_trackers(tracking: TrackingConfig, run_name: str, run_dir: Path) -> list[Tracker]:
    return [t for make in TRACKERS.values() if (t := make(tracking, run_name, run_dir)) is not None]
