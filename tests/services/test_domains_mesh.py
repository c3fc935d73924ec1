"""Several task domains in a real mesh (every service a process, simulated engines and trainer): each
batch holds each domain's share although one domain's rewards take 200 times longer, and every
per-domain number reaches Prometheus, the metrics log and SwanLab's offline run."""

from __future__ import annotations

import re

from launch.bench.domains_bench import DOMAINS, _config, run_mesh, shares

GROUPS_PER_STEP = 5  # weights 0.5/0.3/0.2: 2.5, 1.5 and 1 groups a step, so rounding shows


def _value(page: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}\{{{want}\}} ([\d.e+-]+)$", page, re.M)
    assert m, f"{name}{{{want}}} not on the page"
    return float(m.group(1))


def test_each_batch_holds_each_domains_share_with_a_slow_domain_and_the_numbers_reach_every_tracker(
    tiny_model, tmp_path
):
    config = _config(
        tmp_path,
        "mixed",
        DOMAINS,
        steps=6,
        groups_per_step=GROUPS_PER_STEP,
        time_scale=100.0,
        tokenizer=tiny_model,
        tracking={"swanlab_project": "rollmesh-test", "swanlab_mode": "offline"},
    )
    run = run_mesh(config)
    steps = run["steps"]
    assert len(steps) == 6
    for step in steps:  # every batch: each domain within two groups of its weight, the whole batch
        counts = {d: step[f"domain/{d}/groups"] for d in DOMAINS}
        assert sum(counts.values()) == GROUPS_PER_STEP
        assert all(abs(counts[d] - w * GROUPS_PER_STEP) < 2 for d, (w, _) in DOMAINS.items()), counts
    total = {d: sum(s[f"domain/{d}/groups"] for s in steps) for d in DOMAINS}
    assert all(abs(total[d] - w * 6 * GROUPS_PER_STEP) < 1 for d, (w, _) in DOMAINS.items()), total
    assert shares(steps, {d: w for d, (w, _) in DOMAINS.items()})["judge"]["share_mean"] > 0.1

    pages = run["metrics"]
    for d in DOMAINS:
        assert _value(pages["env-manager"], "rollmesh_env_domain_groups_total", domain=d, result="put") > 0
        assert _value(pages["env-manager"], "rollmesh_env_domain_episode_duration_seconds_count", domain=d) > 0
        assert _value(pages["sample-buffer"], "rollmesh_buffer_domain_handed_out_groups_total", domain=d) >= 6
    # the slow domain's episodes are the slow ones, as its own histogram says
    mean_s = {
        d: _value(pages["env-manager"], "rollmesh_env_domain_episode_duration_seconds_sum", domain=d)
        / _value(pages["env-manager"], "rollmesh_env_domain_episode_duration_seconds_count", domain=d)
        for d in DOMAINS
    }
    assert mean_s["judge"] > mean_s["sandbox"] > mean_s["verifier"]

    [record] = (tmp_path / "mixed" / "swanlog").glob("run-*/run-*.swanlab")
    data = record.read_bytes()
    for d in DOMAINS:
        assert f"domain/{d}/groups".encode() in data and f"domain/{d}/reward_mean".encode() in data
