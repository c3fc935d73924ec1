"""The device map: each engine and the trainer get their GPUs, a map that does not fit the run or
the machine is refused by field before anything starts, and a restarted process keeps its GPUs."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from pydantic import ValidationError

from launch.config import load_config
from launch.device_map import DeviceMapConfig, place, visible_gpus
from launch.supervisor import Supervised

EIGHT = [str(i) for i in range(8)]


def test_disaggregated_engines_of_two_gpus_and_a_trainer_of_four():
    devices = DeviceMapConfig(placement="disaggregated", engine_gpus=[0, 1, 2, 3], trainer_gpus=[4, 5, 6, 7])
    p = place(devices, num_engines=2, gpus_per_engine=2, trainer_procs=4, visible=EIGHT)
    assert p.engines == ["0,1", "2,3"] and p.trainer == "4,5,6,7" and p.trainer_procs == 4


def test_colocated_and_indices_taken_through_cuda_visible_devices():
    devices = DeviceMapConfig(placement="colocated", engine_gpus=[0, 1], trainer_gpus=[1, 0])
    p = place(
        devices, num_engines=2, gpus_per_engine=1, trainer_procs=2, visible=["3", "5"]
    )  # CUDA_VISIBLE_DEVICES=3,5
    assert p.engines == ["3", "5"] and p.trainer == "5,3"
    none = place(DeviceMapConfig(), num_engines=3, gpus_per_engine=1, trainer_procs=1, visible=[])
    assert none.engines == [None, None, None] and none.trainer is None


@pytest.mark.parametrize(
    "devices, message",
    [
        (dict(placement="disaggregated", engine_gpus=[0, 1], trainer_gpus=[1, 2]), "share GPU(s) [1]"),
        (dict(placement="colocated", engine_gpus=[0, 1], trainer_gpus=[0]), "must use the same GPUs"),
        (dict(placement="disaggregated", engine_gpus=[0, 0], trainer_gpus=[1]), "engine_gpus: GPU 0 is listed twice"),
        (dict(placement="disaggregated", engine_gpus=[], trainer_gpus=[1]), "engine_gpus: placement"),
        (dict(placement="none", trainer_gpus=[1]), "devices.placement: 'none' pins nothing"),
        (dict(placement="disaggregated", engine_gpus=[-1], trainer_gpus=[1]), "engine_gpus: GPU indices are >= 0"),
    ],
)
def test_a_map_that_cannot_be_is_refused_by_field(devices, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        DeviceMapConfig(**devices)


def test_a_map_that_does_not_fit_the_run_or_the_machine_is_refused_by_field():
    devices = DeviceMapConfig(placement="disaggregated", engine_gpus=[0, 1, 2], trainer_gpus=[3])
    with pytest.raises(ValueError, match=r"^devices.engine_gpus: 3 GPU\(s\) for run.num_engines=2 .* 4 needed"):
        place(devices, num_engines=2, gpus_per_engine=2, trainer_procs=1, visible=EIGHT)
    with pytest.raises(ValueError, match=r"^run.trainer_procs: 2, but devices.trainer_gpus lists 1"):
        place(devices, num_engines=3, gpus_per_engine=1, trainer_procs=2, visible=EIGHT)
    with pytest.raises(ValueError, match=r"^devices.trainer_gpus: GPU 3 is not on this machine: 3 visible \(0, 1, 2\)"):
        place(devices, num_engines=3, gpus_per_engine=1, trainer_procs=1, visible=["0", "1", "2"])
    with pytest.raises(ValueError, match="none visible"):
        place(devices, num_engines=3, gpus_per_engine=1, trainer_procs=1, visible=[])


def test_the_run_config_checks_the_map_against_its_engines_and_trainer(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "run: {num_engines: 2}\nengine: {type: sglang, tensor_parallel_size: 2}\n"
        "devices: {placement: disaggregated, engine_gpus: [0, 1, 2, 3], trainer_gpus: [4]}\n"
    )
    assert load_config(path).devices.engine_gpus == [0, 1, 2, 3]
    with pytest.raises(Exception, match="devices.engine_gpus: 4 GPU"):
        load_config(path, ["engine.tensor_parallel_size=1"])
    with pytest.raises(Exception, match="engine.type .sim. uses no GPU"):
        load_config(path, ["engine={type: sim}", "devices.engine_gpus=[0, 1]"])
    colocated = ["devices.placement=colocated", "devices.trainer_gpus=[0, 1, 2, 3]", "run.trainer_procs=4"]
    assert load_config(path, colocated).engine.enable_memory_saver  # SGLang frees memory only with it
    with pytest.raises(Exception, match="NCCL refuses"):
        load_config(path, [*colocated, "train_loop.publisher={type: collective}"])


def test_rollmesh_run_refuses_a_gpu_map_on_a_machine_without_those_gpus(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        f"train_loop: {{run_dir: {tmp_path / 'run'}}}\n"
        "devices: {placement: disaggregated, engine_gpus: [0], trainer_gpus: [1]}\n"
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "launch.cli", "run", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "0"},
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "devices.trainer_gpus: GPU 1 is not on this machine: 1 visible (0) (CUDA_VISIBLE_DEVICES)" in proc.stdout
    assert not (tmp_path / "run" / "logs").exists() or not any((tmp_path / "run" / "logs").iterdir())
    assert time.monotonic() - t0 < 60


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 6")
    assert visible_gpus() == ["2", "6"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_a_restarted_process_keeps_its_gpus(tmp_path):
    log = tmp_path / "engine.log"
    code = "import os, sys; print('gpus', os.environ.get('CUDA_VISIBLE_DEVICES')); sys.exit(1)"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], env={"CUDA_VISIBLE_DEVICES": "4,5"}, stdout=out, stderr=subprocess.STDOUT
        )
    s = Supervised("engine-0", proc, log, env={"CUDA_VISIBLE_DEVICES": "4,5"})
    proc.wait(30)
    deadline = time.monotonic() + 30
    while s.restarts == 0 and time.monotonic() < deadline:
        s.check(max_restarts=1, report=lambda line: None)
        time.sleep(0.1)
    s.proc.wait(30)
    assert s.restarts == 1 and log.read_text().count("gpus 4,5") == 2
