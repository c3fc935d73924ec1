"""Verifiable math tasks: reasoning-gym datasets (`rollmesh make-dataset`) and the math_verify reward."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollout.envs.reasoning_gym_data import DatasetError, reasoning_gym_rows
from rollout.rewards import math_verify, resolve_reward

CASES = [
    ("The answer is 42.", "42", 1.0),
    ("So we get $\\boxed{-41}$", "-41", 1.0),
    ("21 - 62 = -41", "-41", 1.0),
    ("The answer is 1.", "-41", 0.0),
    ("I am not sure.", "7", 0.0),
    ("", "7", 0.0),
    ("3/4", "0.75", 1.0),
]


def test_math_verify_reads_free_form_answers_in_any_thread():
    assert resolve_reward("math_verify") is math_verify
    got = [math_verify(r, a) for r, a, _ in CASES]
    assert got == [want for _, _, want in CASES]
    with ThreadPoolExecutor(2) as pool:  # no SIGALRM off the main thread: same verdicts, no error
        assert list(pool.map(lambda c: math_verify(c[0], c[1]), CASES)) == got


def test_reasoning_gym_rows_are_seeded_and_verifiable():
    a = reasoning_gym_rows("chain_sum", 20, seed=1, min_terms=2, max_terms=2, max_digits=2)
    assert a == reasoning_gym_rows("chain_sum", 20, seed=1, min_terms=2, max_terms=2, max_digits=2)
    assert a != reasoning_gym_rows("chain_sum", 20, seed=2, min_terms=2, max_terms=2, max_digits=2)
    assert all(set(r) == {"prompt", "answer", "task"} for r in a)
    # each gold answer scores itself, stated as a sentence
    assert all(math_verify(f"The answer is {r['answer']}.", r["answer"]) == 1.0 for r in a)
    with pytest.raises(DatasetError, match="no task 'chain_summ'"):
        reasoning_gym_rows("chain_summ", 5, seed=0)
    with pytest.raises(DatasetError, match="--param: chain_sum"):
        reasoning_gym_rows("chain_sum", 5, seed=0, no_such_option=3)


def test_make_dataset_cli_writes_jsonl_and_refuses_bad_options(tmp_path):
    out = tmp_path / "train.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "launch.cli",
        "make-dataset",
        "basic_arithmetic",
        "--out",
        str(out),
        "--size",
        "5",
        "--param",
        "max_terms=2",
        "--param",
        "max_digits=1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 5 and all(r["task"] == "basic_arithmetic" for r in rows)
    bad = subprocess.run(cmd[:-2] + ["--param", "max_digits"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "expected key=value" in bad.stderr


def test_make_dataset_exclude_keeps_a_held_out_set_apart(tmp_path):
    """Item i comes from seed + i: seed 1's first five items are seed 0's last four and one more."""
    base = [sys.executable, "-m", "launch.cli", "make-dataset", "chain_sum", "--size", "5", "--param", "max_digits=3"]
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    assert subprocess.run(base + ["--out", str(train), "--seed", "0"], capture_output=True, timeout=120).returncode == 0
    proc = subprocess.run(
        base + ["--out", str(held), "--seed", "1", "--exclude", str(train)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "4 of 5 rows dropped" in proc.stdout, proc.stdout + proc.stderr
    train_prompts = {json.loads(x)["prompt"] for x in train.read_text().splitlines()}
    held_prompts = [json.loads(x)["prompt"] for x in held.read_text().splitlines()]
    assert len(held_prompts) == 1 and held_prompts[0] not in train_prompts
