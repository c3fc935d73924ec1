"""`rollmesh bench async` cut down: the real services on simulated engines and trainer."""

import json
import subprocess
import sys

from tests.cli import rollmesh


def _bench(tiny_model, *args: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "launch.cli",
        "bench",
        "async",
        "--model",
        tiny_model,
        "--steps",
        "1",
        "--warmup",
        "1",
        "--time-scale",
        "200",
        *args,
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The cut-down runs check what each scenario does; speeds and their ratios are the bench's numbers
# (`rollmesh bench async`, docs/benchmarks.md), never a threshold here.


def test_async_and_sync_scenarios_train_every_step_within_the_staleness_bound(tiny_model):
    out = _bench(
        tiny_model, "--scenario", "sync_batch", "--scenario", "async_2", "--no-agentic", "--groups-per-step", "12"
    )
    sync, async2 = out["scenarios"]["sync_batch"], out["scenarios"]["async_2"]
    assert out["staleness_within_bound"] and async2["max_staleness"] <= 2 and sync["max_staleness"] == 0
    assert isinstance(out["rlvr_speedup_async2_vs_sync"], float) and out["efficiency_vs_ideal_async2"] > 0
    # The zero-overhead play of the same rules is reported beside it, and is itself below the ideal.
    assert 0 < out["rules_steady_efficiency_async2"] < 1 and out["efficiency_vs_rules_async2"] > 0
    # Long-tailed lengths (median 1,000 tokens, mean ~1,900) were generated: 96 members make ~180k a step.
    assert sync["generated_tokens_per_step"] > 24_000
    # Synchronous training never stops a group as stale; what async_2 lost is read from the EnvManager.
    # Every step trained --groups-per-step groups: 1 warm-up + 1 measured step of 12.
    assert sync["stale_token_share"] == 0 and 0 <= out["stale_token_share_async2"] < 1
    assert out["groups_per_step"] == 12 and sync["consumed"] == async2["consumed"] == 2 * 12


def test_agentic_providers_with_faults_and_redundancy(tiny_model):
    """`bench async --providers` cut down to its hardest scenario: episodes in provider processes with
    faults injected, redundant members cancelled and counted."""
    out = _bench(tiny_model, "--groups-per-step", "12", "--providers", "--scenario", "providers_faults_redundant")
    [run] = out["scenarios"].values()
    assert run["consumed"] == 2 * 4  # 2 steps of 4 agentic groups each
    assert run["members_cancelled"] > 0 and 0 < run["redundant_token_share"] < 1
    assert isinstance(out["efficiency_faults_redundant"], float)
    assert out["fault_cost_with_redundancy"] is None  # its baseline scenario did not run


def test_tail_batching_with_over_provisioned_members(tiny_model):
    """`bench async --tail` cut down to tail batching with RollPacker's over-provisioned members: every
    step is full and synchronous (staleness 0), and the extra members really ran and were cut."""
    out = _bench(tiny_model, "--groups-per-step", "8", "--tail", "--scenario", "sync_tail_members")
    members = out["scenarios"]["sync_tail_members"]  # + 4 members a group, the first 8 to end kept
    assert members["consumed"] == 2 * 8 and members["max_staleness"] == 0 and out["redundant_prompts"] == 2
    assert members["members_cancelled"] > 0
    assert abs(sum(members["kept_member_length_share"].values()) - 1) < 0.01


def test_an_unknown_scenario_is_refused_by_name(tiny_model):
    res = rollmesh("bench", "async", "--model", tiny_model, "--tail", "--scenario", "async_2")
    assert res.exit_code == 2 and "--scenario: unknown ['async_2']" in res.stderr
