"""`rollmesh bench weights` runs every CPU transport end to end and prints its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_weights_times_every_cpu_transport():
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
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
    cmd = [sys.executable, "-m", "services.cli", "bench", "weights", "--engines", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--engines: must be >= 1" in proc.stderr
