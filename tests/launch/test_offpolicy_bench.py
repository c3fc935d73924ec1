"""`rollmesh bench offpolicy` end to end, cut to one loss, one ratio and 10 steps (its fewest)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.cli import rollmesh


def test_bench_offpolicy_prints_its_table_and_writes_its_plot(tiny_model, tmp_path):
    out_dir = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "launch.cli",
        "bench",
        "offpolicy",
        "--model",
        tiny_model,
        "--loss",
        "ppo_naive",
        "--ratio",
        "2",
        "--steps",
        "10",
        "--audit",
        "--out",
        str(out_dir),
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (row,) = out["by_variant"]
    assert row["label"] == "ppo_naive@2" and 0 <= row["heldout_accuracy"]["mean"] <= 1
    assert row["wall_s"] > 0 and 0 <= row["staleness_mean"] <= 2
    assert out["heldout ppo_naive@2"] == round(row["heldout_accuracy"]["mean"], 3)
    # the audit ran: the policy moved, and μ is the tagged version's own log-prob (float noise)
    assert row["movement"]["policy_kl_1"] > 0 and row["movement"]["audit_mu_err_max"] < 1e-3
    assert 0 <= row["bias"]["repeat_from_previous_step"] <= 1 and row["bias"]["distinct_per_step"] > 0
    assert row["restarts"] == 0 and not list((out_dir / "runs").glob("*-logs"))
    assert (out_dir / "offpolicy.png").stat().st_size > 0
    (full,) = json.loads((out_dir / "offpolicy.json").read_text())
    assert len(full["runs"][0]["curve"]) == 10 and full["runs"][0]["curve_by_version"]


def test_bench_offpolicy_refuses_a_bad_option():
    res = rollmesh("bench", "offpolicy", "--loss", "sgd")
    assert res.exit_code == 2 and "--loss: unknown ['sgd']" in res.stderr


def test_a_run_that_restarted_a_service_says_which_from_the_supervisors_own_report():
    from launch.bench.offpolicy_bench import restarts_in
    from launch.supervisor import Supervised

    lines: list[str] = []
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait(timeout=60)
    Supervised("trainer", dead, finishes=True).check(max_restarts=2, report=lines.append)
    assert len(lines) == 1
    output = "\n".join(["step 4 reward 0.5", *lines, "step 1 reward 0.1", *lines])
    assert restarts_in(output) == {"trainer": 2}
    assert restarts_in("final: steps=10 reward_mean_last5=0.5 heldout_accuracy=0.5 wall_s=3") == {}
