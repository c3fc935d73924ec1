"""`rollmesh bench gpu` (`make gpu-check`) says plainly that it needs CUDA, and exits 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: make gpu-check runs the real check")
def test_gpu_check_without_cuda_exits_2_and_says_why():
    cmd = [sys.executable, "-m", "launch.cli", "bench", "gpu", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no CUDA device visible" in proc.stderr and proc.stdout == ""
