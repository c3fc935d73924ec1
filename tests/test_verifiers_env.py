"""verifiers environments run unchanged against the mesh: ``env_manager.env: {type: verifiers}``
makes ``rollmesh run`` start the environment's driver in its own venv (``.venv-verifiers``, built by
the test set-up) against the agent gateway. The environments are built from the library's own classes
(examples/verifiers/vf_digits.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from services.processes import free_port

VF_PYTHON = ".venv-verifiers/bin/python"


def replayed(run_dir: Path) -> list[dict]:
    """The run's logged rollouts played again by the library with the same completions."""
    proc = subprocess.run(
        [
            VF_PYTHON,
            "tests/verifiers_envs/replay.py",
            run_dir / "verifiers_driver.json",
            run_dir / "verifiers_rollouts.jsonl",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": ".", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x) for x in proc.stdout.splitlines()]


def test_a_verifiers_environment_trains_on_its_own_rollouts_with_its_rubrics_rewards(tmp_path):
    """Two steps of two groups of four of vf_digits' multi-turn environment: the driver plays its rows
    with its own prompt (system prompt, few-shot), turns (env_response) and rubric (two weighted
    functions); every session it ended is a member of its group; the rewards are what the library
    computes for the same completions; the trained trajectories hold both turns."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "launch.cli", "run", "examples/verifiers/digits.yaml", "--fresh"]
    for o in [
        f"train_loop.run_dir={run_dir}",
        "train_loop.steps=2",
        "controller.groups_per_step=2",
        "env_manager.group_size=4",
        "env_manager.env.concurrency=2",
        "env_manager.env.args={kind: retry}",
        f"gateway.port={free_port()}",
    ]:
        cmd += ["--set", o]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2] and all(m["published"] for m in steps)

    rollouts = [json.loads(x) for x in (run_dir / "verifiers_rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) >= 2 * 2 * 4  # at least the trained groups' members, each ended with its reward
    groups = {r["group"] for r in rollouts}
    assert all(sum(r["group"] == g for r in rollouts) == 4 for g in groups)
    # the environment's own prompt: its system prompt and few-shot turn before the row
    assert all([m["role"] for m in r["prompt"]] == ["system", "user", "assistant", "user"] for r in rollouts)
    assert all(r["prompt"][0]["content"] == "Answer with the digit only." for r in rollouts)
    # its env_response after a wrong first answer, then a second turn
    turns = [[m for m in r["completion"] if m["role"] == "assistant"] for r in rollouts]
    again = [r for r, t in zip(rollouts, turns, strict=True) if len(t) == 2]
    assert again and all(1 <= len(t) <= 2 for t in turns)
    assert all(m["content"] == "No. Try again." for r in again for m in r["completion"] if m["role"] == "user")
    assert max(m["turns_mean"] for m in steps) > 1.0  # the trained trajectories hold both turns
    rescored = replayed(run_dir)
    assert sorted(r["session"] for r in rescored) == sorted(r["session"] for r in rollouts)
    assert all(r["library"] == r["logged"] for r in rescored), rescored


def test_an_environment_that_asks_a_judge_off_this_machine_is_refused_by_name(tmp_path):
    spec = {"name": "vf_digits", "args": {"kind": "judged"}, "path": ["examples/verifiers"]}
    code = "import json, sys; from services.verifiers_driver.__main__ import load; load(json.loads(sys.argv[1]))"
    proc = subprocess.run(
        [VF_PYTHON, "-c", code, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": ".", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode != 0
    assert "JudgeRubric asks the judge model at https://api.openai.com/v1/" in proc.stderr


def test_rollmesh_run_without_the_verifiers_venv_says_how_to_make_it(tmp_path):
    cmd = [sys.executable, "-m", "launch.cli", "run", "examples/verifiers/digits.yaml"]
    cmd += ["--set", f"train_loop.run_dir={tmp_path}", "--set", f"env_manager.env.python={tmp_path}/none/python"]
    (tmp_path / "keys.json").write_text(json.dumps({"agent": "sha256:" + "0" * 64}))
    cmd += ["--set", f"gateway.api_keys_path={tmp_path}/keys.json"]  # the driver's key is the one the run issues
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "env_manager.env.python: no interpreter" in proc.stdout + proc.stderr
    assert "make verifiers" in proc.stdout + proc.stderr
    assert "gateway.api_keys_path: a verifiers environment's driver uses the key rollmesh run issues" in (
        proc.stdout + proc.stderr
    )
