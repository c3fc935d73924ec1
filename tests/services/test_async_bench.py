"""`rollmesh bench async` cut down: the real services on simulated engines and trainer."""

import json
import subprocess
import sys


def test_async_beats_sync_batch_within_the_staleness_bound(tiny_model):
    cmd = [sys.executable, "-m", "services.cli", "bench", "async", "--model", tiny_model, "--steps", "3",
           "--warmup", "1", "--engines", "2", "--time-scale", "50", "--scenario", "sync_batch",
           "--scenario", "async_2", "--no-agentic", "--groups-per-step", "12", "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    sync, async2 = out["scenarios"]["sync_batch"], out["scenarios"]["async_2"]
    # Synchronous batch rollout waits for each step's longest response (p99 ~14k tokens);
    # async_ratio 2 keeps the engines busy. The gap is structural, far above noise.
    assert out["rlvr_speedup_async2_vs_sync"] > 1.5, out
    assert out["staleness_within_bound"] and async2["max_staleness"] <= 2 and sync["max_staleness"] == 0
    assert 0 < out["efficiency_vs_ideal_async2"] <= 1.05
    # The zero-overhead play of the same rules is reported beside it, and is itself below the ideal.
    assert 0 < out["rules_steady_efficiency_async2"] < 1 and out["efficiency_vs_rules_async2"] > 0
    assert sync["generated_tokens_per_step"] > 48 * 500  # long-tailed lengths really were generated
    # Every step trained --groups-per-step groups: 1 warm-up + 3 measured steps of 12.
    # Synchronous training never stops a group as stale; what async_2 lost is read from the EnvManager.
    assert sync["stale_token_share"] == 0 and 0 <= out["stale_token_share_async2"] < 1
    assert out["groups_per_step"] == 12 and sync["consumed"] == async2["consumed"] == 4 * 12


def test_agentic_providers_with_faults_and_redundancy(tiny_model):
    """`bench async --providers` cut down: episodes in provider processes, faults injected,
    redundant members cancelled and counted."""
    cmd = [sys.executable, "-m", "services.cli", "bench", "async", "--model", tiny_model, "--steps", "1",
           "--warmup", "1", "--time-scale", "50", "--groups-per-step", "12", "--providers", "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = out["scenarios"]
    assert set(runs) == {"providers", "providers_faults", "providers_redundant", "providers_faults_redundant"}
    assert all(r["consumed"] == 2 * 4 for r in runs.values())  # 2 steps of 4 agentic groups each
    assert runs["providers"]["members_cancelled"] == 0 and runs["providers_redundant"]["members_cancelled"] > 0
    assert 0 < runs["providers_redundant"]["redundant_token_share"] < 1
    for key in ("fault_cost_without_redundancy", "fault_cost_with_redundancy", "kept_length_ratio_redundant_vs_not"):
        assert isinstance(out[key], float), out


def test_tail_batching_against_plain_synchronous(tiny_model):
    """`bench async --tail` cut down: 8 groups a step, 2 more per short round; every step is full and
    synchronous (staleness 0), and cutting the long tail makes steps shorter."""
    cmd = [sys.executable, "-m", "services.cli", "bench", "async", "--model", tiny_model, "--steps", "3",
           "--warmup", "1", "--time-scale", "50", "--groups-per-step", "8", "--tail", "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    sync, tail = out["scenarios"]["sync_batch"], out["scenarios"]["sync_tail"]
    assert sync["consumed"] == tail["consumed"] == 4 * 8 and out["redundant_prompts"] == 2
    assert sync["max_staleness"] == tail["max_staleness"] == 0
    # Its speed is the bench's number, not a threshold here: over 3 measured steps of 8 groups the ratio
    # was 1.02 in one full run (1.2-1.5 in others).
    assert isinstance(out["tail_speedup_vs_sync"], float), out
    assert abs(sum(tail["kept_member_length_share"].values()) - 1) < 0.01
    members = out["scenarios"]["sync_tail_members"]  # + 4 members a group, the first 8 to end kept
    assert members["consumed"] == 4 * 8 and members["max_staleness"] == 0
    # Its extra members really ran and were cut (its speed is the bench's number, not a threshold here:
    # 3 measured steps of 8 groups are too few for a steady ratio).
    assert members["members_cancelled"] > 0 and isinstance(out["tail_members_speedup_vs_sync"], float), out
