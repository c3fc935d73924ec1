"""Training metrics go to metrics.jsonl and, when configured, to TensorBoard and W&B (offline)."""

from __future__ import annotations

import json
import struct

import pytest

from services.metrics_log import MetricsLog, TrackingConfig
from services.trackers import require
from services.trainer.metrics import TrainerMetrics, loss_terms

STEPS = [
    {"step": 1, "loss": 0.5, "reward_mean": 0.25, "clip_frac": 0.1, "published": True},
    {"step": 2, "loss": 0.25, "reward_mean": 0.5, "clip_frac": 0.0, "published": True},
]


def test_jsonl_and_tensorboard_get_every_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path / "metrics.jsonl", TrackingConfig(tensorboard_dir=str(tmp_path / "tb")))
    for m in STEPS:
        log.write(m)
    log.close()
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == STEPS
    acc = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5)]
    assert [e.value for e in acc.Scalars("published")] == [1.0, 1.0]


def test_wandb_offline_run_records_every_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLog(
        tmp_path / "metrics.jsonl",
        TrackingConfig(wandb_project="rollmesh-test", wandb_mode="offline"),
        run_name="t",
        run_dir=tmp_path,
    )
    for m in STEPS:
        log.write(m)
    log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # Each step is recorded more than once (history and its partial updates): compare in order, deduplicated.
    assert list(dict.fromkeys(_history_values(runs[0].read_bytes(), "reward_mean"))) == ["0.25", "0.5"]
    assert list(dict.fromkeys(_history_values(runs[0].read_bytes(), "loss"))) == ["0.5", "0.25"]


def _history_values(data: bytes, key: str) -> list[str]:
    """The logged values of ``key`` in a W&B run file: each history item is protobuf
    ``key`` (field 2: 0x12, length, bytes) followed by ``value_json`` (field 16: 0x82 0x01, length,
    bytes). wandb ships no Python reader for its run files any more, so the test reads the items."""
    tag = b"\x12" + bytes([len(key)]) + key.encode() + b"\x82\x01"
    out, at = [], data.find(tag)
    while at >= 0:
        n = data[at + len(tag)]
        out.append(data[at + len(tag) + 1 : at + len(tag) + 1 + n].decode())
        at = data.find(tag, at + 1)
    return out


def test_swanlab_offline_run_records_every_step_and_each_domains_numbers(tmp_path):
    """SwanLab's offline run files: the metric keys in its run record, each key's values in its log."""
    steps = [m | {"domain/math/reward_mean": 0.125 * m["step"], "domain/code/accuracy": 0.75} for m in STEPS]
    log = MetricsLog(
        tmp_path / "metrics.jsonl",
        TrackingConfig(swanlab_project="rollmesh-test", swanlab_mode="offline"),
        run_name="t",
        run_dir=tmp_path,
    )
    for m in steps:
        log.write(m)
    log.close()
    [record] = (tmp_path / "swanlog").glob("run-*/run-*.swanlab")
    data = record.read_bytes()
    assert _swanlab_values(data, "reward_mean") == [0.25, 0.5]
    assert _swanlab_values(data, "domain/math/reward_mean") == [0.125, 0.25]
    assert _swanlab_values(data, "domain/code/accuracy") == [0.75, 0.75]


def _swanlab_values(data: bytes, key: str) -> list[float]:
    """The logged values of ``key`` in a SwanLab offline run file: each metric record is protobuf with
    the key (field 1: 0x0a, length, bytes) and, a few fields on, the value as a double (field 5: 0x2a, 9,
    then field 1 double: 0x09 and 8 bytes), read here without a protobuf schema."""
    tag = b"\n" + bytes([len(key)]) + key.encode() + b"\x10"
    out, at = [], data.find(tag)
    while at >= 0:
        value = data.find(b"*\t\t", at + len(tag), at + len(tag) + 40)
        out.append(struct.unpack("<d", data[value + 3 : value + 11])[0])
        at = data.find(tag, at + 1)
    return out


def test_a_missing_tracker_fails_at_start_with_the_install_command():
    with pytest.raises(RuntimeError, match=r"pip install 'rollmesh\[track\]'"):
        require("rollmesh_no_such_tracker")


def test_loss_terms_and_trainer_gauges():
    assert loss_terms({"loss": 1.0, "pg_loss": 0.5, "kl_loss": 0.1, "reward_mean": 3}) == {
        "total": 1.0,
        "pg": 0.5,
        "kl": 0.1,
    }
    from prometheus_client import generate_latest

    m = TrainerMetrics()
    m.observe_step(
        {
            **STEPS[0],
            "version": 1,
            "tokens": 100,
            "time_get_s": 1.0,
            "time_train_s": 0.5,
            "time_publish_s": 0.25,
            "domain/math/accuracy": 0.75,
            "domain/math/tokens": 60,
        },
        staleness=[0, 1, 1],
    )
    text = generate_latest(m.registry).decode()
    assert 'rollmesh_trainer_phase_seconds_total{phase="wait_data"} 1.0' in text
    assert 'rollmesh_trainer_loss{term="total"} 0.5' in text
    assert "rollmesh_trainer_staleness_max_versions 1.0" in text
    assert 'rollmesh_trainer_staleness_versions_bucket{le="0.0"} 1.0' in text
    assert "rollmesh_trainer_tokens_per_second 200.0" in text
    assert 'rollmesh_trainer_weight_update_failures_total{cause="load"} 0.0' in text
    assert 'rollmesh_trainer_domain_accuracy_ratio{domain="math"} 0.75' in text
    assert 'rollmesh_trainer_domain_tokens_total{domain="math"} 60.0' in text
    m.observe_step({**STEPS[1], "version": 2, "domain/code/groups": 4}, staleness=[0])  # math not in this batch
    text = generate_latest(m.registry).decode()
    assert 'rollmesh_trainer_domain_groups{domain="math"} 0.0' in text
    assert 'rollmesh_trainer_domain_groups{domain="code"} 4.0' in text
