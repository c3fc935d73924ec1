"""`rollmesh compare`: what it reads from run directories and how it refuses what is not one."""

import json
import subprocess
import sys

from launch.compare import compare, smooth


def _write_run(run_dir, rewards, t0=1000.0, step_s=10.0, summary=None):
    run_dir.mkdir()
    lines = [
        {"step": i + 1, "reward_mean": r, "staleness_mean": 1.0, "wall": t0 + step_s * (i + 1), "time_train_s": i}
        for i, r in enumerate(rewards)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 9, "rew')
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))


def test_windows_wall_time_and_held_out_per_run(tmp_path):
    _write_run(
        tmp_path / "a", [0.0, 0.2, 0.4, 0.6, 0.8], summary={"heldout_before": 0.3, "heldout_after": 0.7, "wall_s": 99.0}
    )
    _write_run(tmp_path / "b", [1.0, 1.0], step_s=3.0)  # no summary yet: a run still going
    out = tmp_path / "plot.png"
    rows = compare([tmp_path / "a", tmp_path / "b"], out, window=2)
    a, b = rows[str(tmp_path / "a")], rows[str(tmp_path / "b")]
    # 5 steps in 4 windows: windows of 2 steps (the torn last line is not a step)
    assert a["steps"] == 5 and a["window_steps"] == 2 and a["reward_by_window"] == [0.1, 0.5, 0.8]
    assert a["train_wall_s"] == 40.0 and a["wall_s"] == 99.0 and (a["heldout_before"], a["heldout_after"]) == (0.3, 0.7)
    assert a["train_s_per_step"] == 2.0 and a["wait_s_per_step"] is None  # an older run without the field
    assert b["steps"] == 2 and b["train_wall_s"] == 3.0 and b["heldout_after"] is None
    assert out.stat().st_size > 1000


def test_smooth_is_a_trailing_mean():
    assert smooth([0.0, 1.0, 2.0, 3.0], 2) == [0.0, 0.5, 1.5, 2.5]
    assert smooth([4.0], 5) == [4.0]


def test_a_directory_without_a_run_exits_2_naming_it(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "launch.cli", "compare", str(tmp_path / "empty")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and f"{tmp_path / 'empty'}: no metrics.jsonl" in proc.stderr
