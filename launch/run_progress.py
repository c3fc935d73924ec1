"""`rollmesh run`'s progress: step N/total, the step's numbers, elapsed time and an ETA.

On a terminal it is one live line (rich) that each step rewrites; piped to a file or a CI log it is
one plain line per step, so the log keeps the whole curve.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def eta_s(elapsed_s: float, done: int, remaining: int) -> float | None:
    """Seconds left at this run's pace so far (None before the first step)."""
    return None if done <= 0 else elapsed_s / done * max(0, remaining)


def clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def step_summary(m: dict) -> str:
    """The numbers of one step (a metrics.jsonl line) that a person watches."""
    return (
        f"reward {m['reward_mean']:.3f}  loss {m['loss']:+.4f}  staleness max {m['staleness_max']}  "
        f"{m['tokens'] / max(m['time_train_s'], 1e-9):,.0f} tok/s train"
        + (f"  turns {m['turns_mean']:.2f}" if m.get("turns_mean", 1) != 1 else "")
        + (f"  over target {m['turns_over_target_share']:.0%}" if "turns_over_target_share" in m else "")
    )


class RunProgress:
    """Shows each trained step against ``total``; ``first_step``: where a resumed run starts."""

    def __init__(self, console: Console, total: int, first_step: int = 0) -> None:
        self.console, self.total, self.first = console, total, first_step
        self.t0 = time.monotonic()
        self.live: Progress | None = None
        if console.is_terminal:
            self.live = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(bar_width=24),
                TimeElapsedColumn(),
                TextColumn("eta {task.fields[eta]}"),
                TextColumn("{task.fields[numbers]}"),
                console=console,
            )
            self.task = self.live.add_task("train", total=total, completed=first_step, eta="--:--", numbers="")
            self.live.start()

    def step(self, m: dict) -> None:
        elapsed = time.monotonic() - self.t0
        eta = clock(eta_s(elapsed, m["step"] - self.first, self.total - m["step"]))
        if self.live is not None:
            self.live.update(self.task, completed=m["step"], eta=eta, numbers=step_summary(m))
        else:
            width = len(str(self.total))
            self.console.print(
                f"step {m['step']:{width}d}/{self.total}  {step_summary(m)}  elapsed {clock(elapsed)}  eta {eta}"
            )

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
