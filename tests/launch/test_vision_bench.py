"""`rollmesh bench vision`, cut to a few groups: a picture per prompt travels once per group through
a real SampleBuffer and redis-server, and the bench says so in its numbers."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_vision_reports_bytes_per_group_and_throughput_side_by_side():
    cmd = [sys.executable, "-m", "launch.cli", "bench", "vision", "--groups", "40", "--image-side", "64", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the picture once per group of 8, plus a hash per trajectory: well under 8 copies
    extra = out["image_bytes_per_group"] - out["text_bytes_per_group"]
    assert out["image_bytes"] <= extra < out["image_bytes"] + 8 * 80
    assert out["copied_per_trajectory_bytes"] == out["text_bytes_per_group"] + 8 * out["image_bytes"]
    assert out["text_groups_per_s"] > 0 and out["image_groups_per_s"] > 0
