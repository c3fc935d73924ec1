"""`rollmesh run`'s progress line and the torch threads it gives each process it starts."""

from __future__ import annotations

import io

from rich.console import Console

from launch.config import load_config
from launch.cpu_threads import thread_overrides, threads_each
from launch.run_progress import RunProgress, clock, eta_s

STEP = {"step": 3, "reward_mean": 0.5, "loss": -0.01, "staleness_max": 1, "tokens": 1000, "time_train_s": 0.5}


def test_eta_is_the_pace_so_far_times_the_steps_left():
    assert eta_s(30.0, 3, 97) == 970.0
    assert eta_s(5.0, 0, 100) is None  # nothing trained yet: no pace to go by
    assert clock(None) == "--:--" and clock(75) == "1:15" and clock(3725) == "1:02:05"


def test_piped_progress_is_one_plain_line_per_step_with_total_and_eta():
    out = io.StringIO()
    progress = RunProgress(Console(file=out, force_terminal=False, width=200), total=300)
    progress.step(STEP)
    progress.close()
    line = out.getvalue().strip()
    assert line.startswith("step   3/300  reward 0.500") and "2,000 tok/s train" in line
    assert "elapsed 0:00" in line and "eta " in line and "--:--" not in line


def test_a_terminal_gets_a_live_line_not_a_line_per_step():
    out = io.StringIO()
    progress = RunProgress(Console(file=out, force_terminal=True, width=200), total=10, first_step=2)
    progress.step(STEP)
    progress.close()
    text = out.getvalue()
    assert "3/10" in text and "\x1b[" in text  # drawn in place with terminal control codes


def test_threads_are_divided_among_the_torch_processes_a_run_starts():
    assert threads_each(2, 2) == 1 and threads_each(16, 3) == 5 and threads_each(1, 4) == 1
    cfg = load_config(None, ["run.num_engines=2", "run.trainer_procs=2"])
    overrides, line = thread_overrides(cfg, 16)
    assert overrides == ["engine.num_threads=4", "trainer.num_threads=4"]
    assert "16 cores, 2 engine(s) and 2 trainer rank(s)" in line


def test_a_thread_count_set_in_the_config_is_kept_and_simulators_get_none():
    cfg = load_config(None, ["engine.num_threads=3"])
    overrides, line = thread_overrides(cfg, 8)
    assert overrides == ["trainer.num_threads=4"] and "engine 3 (config)" in line
    sim = load_config(None, ["engine={type: sim}", "trainer={type: sim}"])
    assert thread_overrides(sim, 8) == ([], "")
