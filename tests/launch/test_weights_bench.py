"""`rollmesh bench weights` runs every CPU transport end to end and prints its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.cli import rollmesh


def test_bench_weights_times_every_cpu_transport():
    cmd = [
        sys.executable,
        "-m",
        "launch.cli",
        "bench",
        "weights",
        "--hidden-size",
        "128",
        "--layers",
        "2",
        "--engines",
        "2",
        "--repeats",
        "2",
        "--bucket-mb",
        "1",
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["engines"] == 2 and out["params_m"] > 0
    for transport in ("disk", "http_buckets", "ipc_shm", "collective_gloo"):  # every engine confirmed every version
        assert out[f"{transport}_load_s"] > 0 and out[f"{transport}_export_s"] > 0
        assert out[f"{transport}_gb_per_s"] > 0
        assert out[f"{transport}_checksums_equal"] is True  # each engine holds exactly the trainer's weights
    assert out["load_speedup_http_buckets_vs_disk"] > 0 and out["load_speedup_collective_gloo_vs_disk"] > 0


def test_bench_weights_refuses_a_bad_option():
    res = rollmesh("bench", "weights", "--engines", "0")
    assert res.exit_code == 2 and "--engines: must be >= 1" in res.stderr


def test_bench_weights_delta_compares_whole_delta_and_adapter_updates_over_training_steps(tiny_model, tmp_path):
    config = tmp_path / "run.yaml"  # the quickstart's task and trainer on the tiny model
    config.write_text(
        f"model_path: {tiny_model}\n"
        "env_manager: {dataset_path: examples/find_digit_train.jsonl, group_size: 4}\n"
        "trainer: {lr: 0.001}\n"
    )
    cmd = [sys.executable, "-m", "launch.cli", "bench", "weights", "--delta", "--config", str(config)]
    # LoRA adapters of rank 2: a third engine gets their factors alone (and two more, over disk).
    args = [*cmd, "--steps", "2", "--bucket-mb", "1", "--lora-rank", "2", "--json"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["steps"] == 2 and out["engine_dtype"] == "bfloat16" and out["checksums_equal"] is True
    assert 0 < out["changed_share_min"] <= out["changed_share_median"] <= out["changed_share_max"] <= 1
    assert out["full_bytes_mb"] > 0 and out["delta_bytes_mb"] > 0 and out["full_load_s"] > 0 < out["delta_load_s"]
    assert out["lora_rank"] == 2 and out["adapter_bytes_mb"] < out["delta_bytes_mb"] < out["full_bytes_mb"]
    assert out["bytes_ratio_full_vs_adapter"] > 10 and out["adapter_load_s"] > 0
    # and over disk: whole to a fourth engine, the adapter's directory to a fifth that serves it by name
    assert out["served_adapter_bytes_mb"] * 10 < out["disk_full_bytes_mb"] and out["served_adapter_load_s"] > 0
    # and over ipc and collective, whole and as factors, to the first and third engines
    assert out["collective_adapter_bytes_mb"] * 10 < out["collective_full_bytes_mb"]
    assert all(out[f"{k}_{w}_load_s"] > 0 for k in ("ipc", "collective") for w in ("full", "adapter"))
    assert out["encoding_bytes_mb_chosen"] <= min(
        out["encoding_bytes_mb_sparse"], out["encoding_bytes_mb_changed_tensors"]
    )
    # Options of the other mode are refused, not ignored; so is a run of fewer than two steps.
    refused = rollmesh(*cmd[3:], "--layers", "2")
    assert (
        refused.exit_code == 2
        and "--delta: trains the config's model on two engines, not with --layers" in refused.stderr
    )
    one = rollmesh(*cmd[3:], "--steps", "1")
    assert one.exit_code == 2 and "--steps: must be >= 2" in one.stderr
