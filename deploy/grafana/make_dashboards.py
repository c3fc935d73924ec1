"""Writes the Grafana dashboards in deploy/grafana/dashboards/ (provisioned JSON).

The PromQL lives here, readable; the JSON is generated: edit this file, then run
``python deploy/grafana/make_dashboards.py``. tests/deploy checks that the committed JSON is what
this script writes and that every expression returns data from a live mesh.
"""

import json
import sys
from pathlib import Path

DS = {"type": "prometheus", "uid": "rollmesh-prometheus"}
R = "$__rate_interval"


def panel(pid, title, targets, unit="short", x=0, y=0, w=12, h=8, kind="timeseries", stack=False, desc=""):
    p = {
        "id": pid,
        "type": kind,
        "title": title,
        "description": desc,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(65 + i), "datasource": DS, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }
    if stack:
        p["fieldConfig"]["defaults"]["custom"] = {"stacking": {"mode": "normal"}, "fillOpacity": 40}
    if kind == "heatmap":
        p["options"] = {"calculate": False, "yAxis": {"unit": unit}, "color": {"scheme": "Oranges"}}
        for t in p["targets"]:
            t["format"] = "heatmap"
    if kind == "stat":
        p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"}
    return p


def layout(specs):
    panels, x, y, row_h = [], 0, 0, 0
    for i, s in enumerate(specs, 1):
        w = s.pop("w", 12)
        h = s.pop("h", 8)
        if x + w > 24:
            x, y, row_h = 0, y + row_h, 0
        panels.append(panel(i, x=x, y=y, w=w, h=h, **s))
        x += w
        row_h = max(row_h, h)
    return panels


def dashboard(uid, title, desc, specs, variables=()):
    return {
        "uid": uid,
        "title": title,
        "description": desc,
        "tags": ["rollmesh"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": list(variables)},
        "annotations": {"list": []},
        "panels": layout(specs),
    }


def rate_mean(metric: str) -> str:
    """Mean of a histogram or summary over the rate window."""
    return f"sum(rate({metric}_sum[{R}])) / sum(rate({metric}_count[{R}]))"


def q(p: float, metric: str, by: str = "", where: str = "") -> str:
    """Quantile ``p`` of a histogram over the rate window (``by``: extra labels to keep; ``where``: a
    label selector)."""
    selector = f"{{{where}}}" if where else ""
    return f"histogram_quantile({p}, sum by (le{by}) (rate({metric}_bucket{selector}[{R}])))"


overview = dashboard(
    "rollmesh-overview",
    "rollmesh / overview",
    "Throughput, where a training step's time goes, and learning progress.",
    [
        dict(
            title="Generated tokens/s (all engines)",
            unit="short",
            w=8,
            targets=[
                (f"sum(rate(rollmesh_proxy_generated_tokens_total[{R}]))", "generated"),
                (f"sum(rate(rollmesh_trainer_tokens_total[{R}]))", "trained (loss tokens)"),
            ],
        ),
        dict(
            title="Trajectories/s",
            w=8,
            targets=[
                (f"sum(rate(rollmesh_env_episodes_total[{R}]))", "rolled out"),
                (f"sum(rate(rollmesh_trainer_trajectories_total[{R}]))", "trained on"),
            ],
        ),
        dict(
            title="Policy version",
            w=8,
            targets=[
                ("max(rollmesh_controller_policy_version)", "controller"),
                ("max(rollmesh_trainer_policy_version)", "trainer"),
                ("min(rollmesh_proxy_engine_weight_version)", "slowest engine"),
            ],
        ),
        dict(
            title="Step time breakdown (seconds per step)",
            unit="s",
            stack=True,
            w=12,
            desc="wait_data = waiting for fresh groups (generation and reward are the bottleneck); "
            "weight_sync = export + suspend + load + resume.",
            targets=[
                (
                    f"sum by (phase) (rate(rollmesh_trainer_phase_seconds_total[{R}]))"
                    f" / scalar(sum(rate(rollmesh_trainer_steps_total[{R}])))",
                    "{{phase}}",
                )
            ],
        ),
        dict(
            title="Rollout time per turn (mean)",
            unit="s",
            w=12,
            targets=[
                (rate_mean("rollmesh_env_generation_latency_seconds"), "generation"),
                (rate_mean("rollmesh_env_step_latency_seconds"), "env step"),
                (rate_mean("rollmesh_env_reward_latency_seconds"), "reward"),
            ],
        ),
        dict(
            title="Reward",
            w=12,
            targets=[
                ("max(rollmesh_trainer_reward_mean)", "trained batch mean"),
                (rate_mean("rollmesh_env_trajectory_reward"), "rollout mean"),
            ],
        ),
        dict(title="Loss terms", w=12, targets=[("max by (term) (rollmesh_trainer_loss)", "{{term}}")]),
        dict(
            title="Clip fraction and KL",
            w=12,
            targets=[
                ("max(rollmesh_trainer_clip_fraction_ratio)", "clip fraction"),
                ("max(rollmesh_trainer_approx_kl)", "approx KL"),
            ],
        ),
        dict(
            title="Train tokens/s (compute only)",
            w=12,
            targets=[("max(rollmesh_trainer_tokens_per_second)", "tokens/s")],
        ),
    ],
)

staleness = dashboard(
    "rollmesh-staleness",
    "rollmesh / staleness",
    "How off-policy the trained samples are, and how admission keeps them within async_ratio.",
    [
        dict(
            title="Staleness at consumption (trajectories per version lag)",
            kind="heatmap",
            w=12,
            targets=[(f"sum by (le) (increase(rollmesh_trainer_staleness_versions_bucket[{R}]))", "{{le}}")],
        ),
        dict(
            title="Largest staleness vs the bound",
            w=12,
            targets=[
                ("max(rollmesh_trainer_staleness_max_versions)", "max in last batch"),
                ("max(rollmesh_controller_async_ratio_versions)", "async_ratio bound"),
            ],
        ),
        dict(
            title="Sample age at hand-out",
            unit="s",
            w=12,
            targets=[(q(0.5, "rollmesh_buffer_age_seconds"), "p50"), (q(0.99, "rollmesh_buffer_age_seconds"), "p99")],
        ),
        dict(
            title="Version lag per engine",
            w=12,
            targets=[
                ("scalar(max(rollmesh_controller_policy_version)) - rollmesh_proxy_engine_weight_version", "{{engine}}")
            ],
        ),
        dict(
            title="Off-policy: ratio and log-prob mismatch",
            desc="π/μ, the current policy over the one that sampled the tokens (1 = on-policy); "
            "|log μ − log π_prox| on tokens sampled by the trainer's own weights (engine vs trainer numerics) "
            "and on older ones (numerics plus staleness); KL(μ ‖ π_prox) on the older ones: how far the policy "
            "moved since they were sampled (docs/losses.md: where it costs learning).",
            w=12,
            targets=[
                ("max(rollmesh_trainer_behavior_ratio_mean)", "mean π/μ"),
                ("max(rollmesh_trainer_logprob_mismatch_fresh_nats)", "mismatch, fresh tokens"),
                ("max(rollmesh_trainer_logprob_mismatch_stale_nats)", "mismatch, stale tokens"),
                ("max(rollmesh_trainer_stale_policy_kl_nats)", "KL(μ ‖ π_prox), stale tokens"),
            ],
        ),
        dict(
            title="Admission pressure (groups)",
            w=12,
            targets=[
                ("max(rollmesh_controller_admission_capacity_groups)", "free slots"),
                ("max(rollmesh_controller_in_flight_groups)", "in flight"),
                ("max(rollmesh_controller_groups_per_step_groups)", "groups per step"),
            ],
        ),
        dict(
            title="Admission rate (groups/s)",
            w=12,
            targets=[
                (f"sum(rate(rollmesh_controller_admitted_groups_total[{R}]))", "granted"),
                (f"sum(rate(rollmesh_controller_admit_refused_groups_total[{R}]))", "refused"),
                (f"sum(rate(rollmesh_controller_finished_groups_total[{R}]))", "used (finished)"),
                (f"sum(rate(rollmesh_controller_released_unused_groups_total[{R}]))", "released unused"),
            ],
        ),
        dict(
            title="Generated tokens lost to the bound (share)",
            unit="percentunit",
            w=12,
            desc="Tokens of groups the EnvManager stopped as staler than async_ratio: generated, never trained. "
            "They are the groups with the longest responses, so a high share also biases training toward short ones.",
            targets=[
                (
                    f"sum(rate(rollmesh_env_stale_tokens_total[{R}])) / "
                    f"sum(rate(rollmesh_env_generated_tokens_total[{R}]))",
                    "stale share",
                )
            ],
        ),
        dict(
            title="Groups dropped (per second, by reason)",
            w=12,
            targets=[(f"sum by (reason) (rate(rollmesh_buffer_dropped_groups_total[{R}]))", "{{reason}}")],
        ),
        dict(
            title="Staleness at hand-out (buffer, p50 / p99)",
            w=12,
            targets=[
                (q(0.5, "rollmesh_buffer_staleness_versions"), "p50"),
                (q(0.99, "rollmesh_buffer_staleness_versions"), "p99"),
            ],
        ),
    ],
)

health = dashboard(
    "rollmesh-health",
    "rollmesh / service health",
    "Every service: up, latency, queues, suspensions, weight updates, failures.",
    [
        dict(
            title="Services up",
            kind="stat",
            w=24,
            h=4,
            targets=[
                ('up{job=~"engine|llm-proxy|sample-buffer|controller|env-manager|trainer"}', "{{job}} {{instance}}")
            ],
        ),
        dict(
            title="Engines in rotation",
            w=8,
            targets=[
                ("sum(rollmesh_proxy_engines_in_rotation)", "in rotation"),
                ("sum(rollmesh_proxy_engines_configured)", "configured"),
            ],
        ),
        dict(
            title="Requests by finish reason (per second)",
            w=8,
            targets=[(f"sum by (finish) (rate(rollmesh_proxy_requests_total[{R}]))", "{{finish}}")],
        ),
        dict(
            title="Tokens/s per engine",
            w=8,
            targets=[(f"sum by (engine) (rate(rollmesh_proxy_generated_tokens_total[{R}]))", "{{engine}}")],
        ),
        dict(
            title="Generate latency (proxy)",
            unit="s",
            w=8,
            targets=[
                (q(0.5, "rollmesh_proxy_generate_latency_seconds"), "p50"),
                (q(0.99, "rollmesh_proxy_generate_latency_seconds"), "p99"),
            ],
        ),
        dict(
            title="Time to first token",
            unit="s",
            w=8,
            targets=[
                (q(0.5, "rollmesh_proxy_time_to_first_token_seconds"), "p50 (proxy)"),
                (q(0.99, "rollmesh_proxy_time_to_first_token_seconds"), "p99 (proxy)"),
                (q(0.99, "rollmesh_engine_time_to_first_token_seconds"), "p99 (embedded engines)"),
            ],
        ),
        dict(
            title="Queueing time",
            unit="s",
            w=8,
            targets=[
                (q(0.99, "rollmesh_proxy_queue_time_seconds"), "p99 gate + engine queue"),
                (q(0.99, "rollmesh_engine_queue_time_seconds"), "p99 engine queue"),
            ],
        ),
        dict(
            title="In flight",
            w=8,
            targets=[
                ("sum(rollmesh_proxy_in_flight_requests)", "proxy requests"),
                ("sum by (engine) (rollmesh_proxy_engine_in_flight_requests)", "{{engine}}"),
                ("sum(rollmesh_env_running_episodes)", "episodes"),
            ],
        ),
        dict(
            title="Suspended (weight update in progress)",
            w=8,
            targets=[
                ("max(rollmesh_proxy_suspended)", "proxy gate closed"),
                ("max(rollmesh_controller_suspended)", "controller updating"),
            ],
        ),
        dict(
            title="Engine batch (embedded engines)",
            w=8,
            targets=[
                ("sum by (instance) (rollmesh_engine_running_requests)", "running {{instance}}"),
                ("sum by (instance) (rollmesh_engine_waiting_requests)", "waiting {{instance}}"),
            ],
        ),
        dict(
            title="Weight updates (per 5m, by result)",
            w=8,
            targets=[("sum by (result) (increase(rollmesh_controller_weight_updates_total[5m]))", "{{result}}")],
        ),
        dict(
            title="Weight update failures (per 5m, by cause)",
            w=8,
            targets=[
                ("sum by (cause) (increase(rollmesh_trainer_weight_update_failures_total[5m]))", "trainer: {{cause}}"),
                ("sum by (cause) (increase(rollmesh_proxy_weight_update_failures_total[5m]))", "engine: {{cause}}"),
            ],
        ),
        dict(
            title="Weight update duration",
            unit="s",
            w=12,
            targets=[
                (q(0.5, "rollmesh_trainer_weight_update_duration_seconds"), "p50 export to resume"),
                (q(0.99, "rollmesh_proxy_weight_update_duration_seconds"), "p99 load on the engines"),
            ],
        ),
        dict(
            title="Weights published per update",
            unit="bytes",
            w=12,
            targets=[
                (
                    f"sum(rate(rollmesh_trainer_weight_update_bytes_total[{R}]))"
                    f" / sum(rate(rollmesh_trainer_weight_update_duration_seconds_count[{R}]))",
                    "bytes per update",
                ),
            ],
        ),
        dict(
            title="SampleBuffer depth (groups)",
            w=8,
            targets=[
                ("sum(rollmesh_buffer_depth_groups)", "waiting"),
                ("sum(rollmesh_buffer_in_flight_groups)", "handed out, not acked"),
                ("sum(rollmesh_buffer_capacity_groups)", "capacity"),
            ],
        ),
        dict(
            title="SampleBuffer Get latency",
            unit="s",
            w=8,
            targets=[(q(0.99, "rollmesh_buffer_get_latency_seconds"), "p99")],
        ),
        dict(
            title="Env step and reward latency (p99, by env)",
            unit="s",
            w=8,
            targets=[
                (q(0.99, "rollmesh_env_step_latency_seconds", ", env"), "step {{env}}"),
                (q(0.99, "rollmesh_env_reward_latency_seconds", ", env"), "reward {{env}}"),
            ],
        ),
        dict(
            title="Episodes by finish reason (per second)",
            w=12,
            targets=[(f"sum by (finish) (rate(rollmesh_env_episodes_total[{R}]))", "{{finish}}")],
        ),
        dict(
            title="Groups by result (per second)",
            w=12,
            targets=[(f"sum by (result) (rate(rollmesh_env_groups_total[{R}]))", "{{result}}")],
        ),
        dict(
            title="Reward service: scores by outcome (per second)",
            w=12,
            desc="ok, or 0 for a fault: timeout and raised cut by the service, fault contained by the verifier "
            "(its cause in rollmesh_reward_reward_failures_total)",
            targets=[(f"sum by (outcome) (rate(rollmesh_reward_scores_total[{R}]))", "{{outcome}}")],
        ),
        dict(
            title="Reward service: score latency (the wait for a slot included)",
            unit="s",
            w=12,
            targets=[
                (q(0.5, "rollmesh_reward_score_seconds"), "p50"),
                (q(0.99, "rollmesh_reward_score_seconds"), "p99"),
            ],
        ),
    ],
)

# A multi-domain run's domains (env_manager.domains), several at once; a run of one task has none.
DOMAIN = {
    "name": "domain",
    "label": "domain",
    "type": "query",
    "datasource": DS,
    "query": {"query": "label_values(rollmesh_env_domain_groups_total, domain)", "refId": "domains"},
    "definition": "label_values(rollmesh_env_domain_groups_total, domain)",
    "refresh": 2,
    "multi": True,
    "includeAll": True,
    "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
}
D = 'domain=~"$domain"'

domains = dashboard(
    "rollmesh-domains",
    "rollmesh / domains",
    "A multi-domain run (env_manager.domains, docs/domains.md): each domain's share of the batches, how it "
    "learns, and what its episodes and rewards cost.",
    [
        dict(
            title="Groups per training step, by domain",
            stack=True,
            w=8,
            desc="The last step's batch by domain (the buffer assembles it by the domains' weights)",
            targets=[(f"sum by (domain) (rollmesh_trainer_domain_groups{{{D}}})", "{{domain}}")],
        ),
        dict(
            title="Reward mean, by domain",
            w=8,
            targets=[(f"max by (domain) (rollmesh_trainer_domain_reward_mean{{{D}}})", "{{domain}}")],
        ),
        dict(
            title="Accuracy (reward >= 1), by domain",
            unit="percentunit",
            w=8,
            targets=[(f"max by (domain) (rollmesh_trainer_domain_accuracy_ratio{{{D}}})", "{{domain}}")],
        ),
        dict(
            title="Response length (generated tokens per answer), by domain",
            w=8,
            targets=[(f"max by (domain) (rollmesh_trainer_domain_response_tokens{{{D}}})", "{{domain}}")],
        ),
        dict(
            title="Answers cut at max_new_tokens, by domain",
            unit="percentunit",
            w=8,
            targets=[(f"max by (domain) (rollmesh_trainer_domain_truncated_ratio{{{D}}})", "{{domain}}")],
        ),
        dict(
            title="Staleness of trained answers (versions), by domain",
            w=8,
            targets=[(f"max by (domain) (rollmesh_trainer_domain_staleness_versions{{{D}}})", "{{domain}}")],
        ),
        dict(
            title="Tokens trained per second, by domain",
            w=8,
            targets=[(f"sum by (domain) (rate(rollmesh_trainer_domain_tokens_total{{{D}}}[{R}]))", "{{domain}}")],
        ),
        dict(
            title="Groups by domain and result (per second)",
            w=8,
            desc="put, filtered (all rewards equal: no signal), stale, failed: a domain often filtered is drawn "
            "more often (env_manager.domain_oversampling)",
            targets=[
                (
                    f"sum by (domain, result) (rate(rollmesh_env_domain_groups_total{{{D}}}[{R}]))",
                    "{{domain}} {{result}}",
                )
            ],
        ),
        dict(
            title="Episode duration p90, by domain",
            unit="s",
            w=8,
            targets=[(q(0.9, "rollmesh_env_domain_episode_duration_seconds", ", domain", D), "{{domain}}")],
        ),
        dict(
            title="Reward faults (per 5m), by domain and cause",
            w=8,
            desc="Scores cut to 0 by a verifier's fault: a domain whose reward service is down shows here",
            targets=[
                (
                    f"sum by (domain, cause) (increase(rollmesh_env_domain_reward_failures_total{{{D}}}[5m]))",
                    "{{domain}} {{cause}}",
                )
            ],
        ),
        dict(
            title="Buffer: groups waiting, by domain",
            w=8,
            targets=[(f"sum by (domain) (rollmesh_buffer_domain_depth_groups{{{D}}})", "{{domain}}")],
        ),
        dict(
            title="Buffer: slots filled by other domains (per 5m)",
            w=8,
            desc="A batch waited buffer.domain_wait_s for the domain's groups and took others' instead",
            targets=[
                (
                    f"sum by (domain) (increase(rollmesh_buffer_domain_substituted_groups_total{{{D}}}[5m]))",
                    "{{domain}}",
                )
            ],
        ),
    ],
    variables=[DOMAIN],
)

DASHBOARDS = {"overview": overview, "staleness": staleness, "health": health, "domains": domains}


def write(out_dir: Path) -> None:
    for name, d in DASHBOARDS.items():
        (out_dir / f"{name}.json").write_text(json.dumps(d, indent=2) + "\n")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "dashboards")
