"""`rollmesh bench distill`'s arithmetic: the first step at the target, medians over seeds, the ratio to
GRPO's steps, and the curve read from a run's files. (Its runs are `rollmesh run`s of the example, as
tests/test_run_e2e.py runs one; the bench itself is `make examples`' and its numbers docs/bench/'s.)"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from launch.bench import BadOption
from launch.bench.distill_bench import _stop_at, curve_of, reached, run, summarise


def _run(*points: tuple[int, float]) -> dict:
    return {"heldout": [{"step": s, "accuracy": a, "train_wall_s": 2.0 * s} for s, a in points]}


def test_each_variant_counts_its_median_steps_to_the_target_and_its_share_of_grpos():
    runs = {
        "grpo": [_run((0, 0.1), (40, 0.5), (80, 0.8)), _run((0, 0.1), (40, 0.85)), _run((0, 0.1), (100, 0.6))],
        "top8": [_run((0, 0.1), (10, 0.9)), _run((0, 0.1), (10, 0.7), (20, 0.8)), _run((0, 0.1), (10, 0.95))],
    }
    got = summarise(runs, 0.8, steps=100)
    assert got["grpo.steps_to_target"] == 80  # of 80, 40 and never (101)
    assert got["grpo.reached"] == 2 and got["grpo.train_s_to_target"] == 120.0  # of 160 s and 80 s
    assert got["top8.steps_to_target"] == 10 and got["top8.reached"] == 3
    assert got["top8.steps_vs_grpo"] == pytest.approx(10 / 80)
    assert got["grpo.heldout_last"] == 0.8
    assert reached(runs["grpo"][2]["heldout"], 0.8) is None


def test_a_runs_curve_puts_each_evaluation_at_its_step_and_its_training_time(tmp_path):
    steps = [
        {"step": i, "wall": 100.0 + 3 * i, "time_get_s": 1.0, "time_train_s": 1.5, "time_publish_s": 0.5}
        for i in (1, 2)
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(s) for s in steps))
    heldout = [
        {"step": None, "when": "before training", "accuracy": 0.1},
        {"step": 2, "when": "step 2", "accuracy": 0.5},
        {"step": None, "when": "after training", "accuracy": 0.6},
    ]
    (tmp_path / "heldout.jsonl").write_text("\n".join(json.dumps(h) for h in heldout))
    got = curve_of(tmp_path)
    # step 1 started 3 s (its phases) before it ended at 103: training began at 100
    assert got["heldout"] == [
        {"step": 0, "accuracy": 0.1, "train_wall_s": 0.0},
        {"step": 2, "accuracy": 0.5, "train_wall_s": 6.0},
        {"step": 2, "accuracy": 0.6, "train_wall_s": 6.0},
    ]
    assert got["steps"] == 2 and got["train_wall_s"] == 6.0


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"variants": ["ppo"]}, "--variant"),
        ({"seeds": 0}, "--seeds"),
        ({"target": 1.5}, "--target"),
        ({"teacher": "runs/nowhere"}, "--teacher"),
    ],
)
def test_bad_options_are_refused_by_name_before_any_run(kw, field, tmp_path):
    args = {"variants": None, "seeds": 1, "steps": 1, "eval_every": 1, "target": 0.8, "teacher": str(tmp_path)}
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(BadOption, match=field):
        run(**(args | kw), out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_run_is_stopped_once_held_out_at_the_target_during_training(tmp_path):
    heldout = tmp_path / "heldout.jsonl"
    # before training (step None) at the target does not count; step 10 below it neither
    heldout.write_text(json.dumps({"step": None, "accuracy": 0.9}) + "\n" + json.dumps({"step": 10, "accuracy": 0.5}))

    def evaluate_step_20():
        time.sleep(1)
        with heldout.open("a") as f:
            f.write("\n" + json.dumps({"step": 20, "accuracy": 0.85}))

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    writer = threading.Thread(target=evaluate_step_20)
    writer.start()
    try:
        assert _stop_at(proc, heldout, 0.8, time.monotonic() + 30) is True
        assert proc.returncode is not None  # stopped, not waited out
    finally:
        proc.kill()
        writer.join()
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    assert _stop_at(done, heldout, None, time.monotonic() + 30) is False and done.returncode == 0
