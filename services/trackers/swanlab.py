"""SwanLab (``train_loop.tracking.swanlab_project``), the tracker ROLL's runs report to; offline mode
keeps the run under ``RUN_DIR/swanlog`` (``swanlab sync`` uploads it later).

SwanLab declares protobuf < 7 while rollmesh's gRPC stubs need 7; its tracker runs on protobuf 7
(the test logs a run offline and reads it back), so it is installed without its dependencies and
theirs are listed apart (the Makefile's set-up does both)."""

from __future__ import annotations

from pathlib import Path

from services.trackers import require

INSTALL = (
    "pip install --no-deps swanlab==0.10.3 && pip install click nvidia-ml-py orjson platformdirs psutil pwinput "
    "pydantic-settings pyecharts pyroaring rich watchdog wrapt"
)


class SwanLab:
    def __init__(self, project: str, mode: str, run_name: str, run_dir: Path) -> None:
        swanlab = require("swanlab", INSTALL)
        self.run = swanlab.init(
            project=project, experiment_name=run_name, logdir=str(run_dir / "swanlog"), mode=mode, reinit=True
        )

    def log(self, numbers: dict[str, float], step: int) -> None:
        self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()
