"""TensorBoard event files (``train_loop.tracking.tensorboard_dir``)."""

from __future__ import annotations

from services.trackers import require


class TensorBoard:
    def __init__(self, log_dir: str) -> None:
        require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir)

    def log(self, numbers: dict[str, float], step: int) -> None:
        for k, v in numbers.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
