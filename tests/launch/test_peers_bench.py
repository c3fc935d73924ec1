"""`rollmesh bench peers`' own parts: what TRL is given, the numbers it reports, its refusals. The
side-by-side runs themselves take minutes each: `rollmesh bench peers` (docs/benchmarks.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launch.bench.peers_bench import TASKS, Task, _cpu_between, _task_spec, compare, peer_pins, step_profile
from launch.config import load_config
from tests.cli import rollmesh


@pytest.mark.parametrize("name", sorted(TASKS))
def test_trl_is_given_what_the_example_fixes(name, tmp_path):
    task = TASKS[name]
    cfg = load_config(task.config, [])
    spec = _task_spec(task, tmp_path, seed=3)
    em = cfg.env_manager
    assert spec["model_path"] == cfg.model_path and spec["train_path"] == em.dataset_path
    assert spec["heldout_path"] == cfg.run.heldout_path and spec["reward"] == em.reward
    assert (spec["group_size"], spec["prompts_per_step"]) == (em.group_size, cfg.controller.groups_per_step)
    assert spec["lr"] == cfg.trainer.lr and spec["max_new_tokens"] == em.episode.sampling.max_new_tokens
    assert spec["temperature"] == em.episode.sampling.temperature and spec["steps"] == task.steps
    assert spec["seed"] == 3


def test_trls_environment_pins_rollmeshs_own_model_code():
    import importlib.metadata

    pins = dict(p.split("==") for p in peer_pins())
    assert pins["transformers"] == importlib.metadata.version("transformers")
    assert pins["torch"] == importlib.metadata.version("torch") and "trl" in pins


def test_the_step_profile_and_the_ratios():
    steps = [
        {"wall": 10.0 + 3 * i, "time_get_s": 2.0 * (i % 2), "time_train_s": 0.5, "time_publish_s": 0.25}
        for i in range(5)
    ]
    p = step_profile(steps)
    assert p["get_s"] == pytest.approx(0.8) and p["train_s"] == 0.5 and p["publish_s"] == 0.25
    assert p["step_s_median"] == 3.0 and p["other_s"] == pytest.approx(3.0 - 0.75 - 1.0)
    task = Task("examples/quickstart.yaml", steps=4, eval_every=2, target=0.8, warmup=1)
    curve = lambda *acc: [{"step": 2 * i, "accuracy": a, "train_wall_s": 10.0 * i} for i, a in enumerate(acc)]  # noqa: E731
    trl = {"step_s_median": 2.0, "train_wall_s": 40.0, "heldout": curve(0.1, 0.5, 0.9)}
    mesh = {"step_s_median": 1.0, "train_wall_s": 20.0, "heldout": curve(0.1, 0.85, 0.9)}
    out = compare(task, trl, mesh)
    assert out["step_speedup"] == 2.0 and out["wall_speedup_same_steps"] == 2.0
    assert out["time_to_target_speedup"] == 2.0  # TRL reaches 0.8 at 20 s, rollmesh at 10 s
    assert out["heldout_before"] == {"trl": 0.1, "rollmesh": 0.1}


def test_cpu_is_counted_per_role_a_restarted_process_from_zero():
    first = {1: ("engine", 10.0), 2: ("trainer", 5.0)}
    last = {1: ("engine", 12.0), 3: ("trainer", 1.5), 4: ("trainer", 0.5)}
    assert _cpu_between(first, last) == {"engine": 2.0, "trainer": 2.0}


def test_an_unknown_task_is_refused_by_name():
    res = rollmesh("bench", "peers", "--task", "chess")
    assert res.exit_code == 2 and "--task" in res.output and "quickstart" in res.output


def test_where_trls_environment_cannot_be_built_it_says_so_in_one_line_and_fails(tmp_path):
    """No package index (pip finds no TRL): one line naming the environment, exit 1."""
    env = os.environ | {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull}
    cmd = [sys.executable, "-m", "launch.cli", "bench", "peers", "--task", "quickstart"]
    proc = subprocess.run(
        [*cmd, "--peers-venv", str(tmp_path / "peers")], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "TRL's environment" in errors[0] and str(tmp_path / "peers") in errors[0]
    assert not (tmp_path / "peers" / ".installed").exists()
