"""The trainer process's Prometheus metrics: steps, where a step's time goes, losses, weight sync.

A step's time is split into phases (``rollmesh_trainer_phase_seconds_total``): ``wait_data``
(waiting for enough fresh groups: generation and reward are the bottleneck), ``train``,
``weight_sync`` (export + suspend + load + resume) and ``checkpoint``. ``rate()`` of each over the
same window is the step-time breakdown the overview dashboard shows.
"""

from __future__ import annotations

import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.metrics import SLOW_BUCKETS_S, VERSION_BUCKETS, histogram, init_labels
from services.metrics_log import MetricsLog
from trainer.ports import TrainObserver

PHASES = ("wait_data", "train", "weight_sync", "checkpoint")
# Why publishing new weights failed: exporting them, suspending generation (BeginUpdate),
# loading them on the engines, or committing the update.
UPDATE_FAILURE_CAUSES = ("export", "begin", "load", "commit")
# Training metrics exported as gauges (name in metrics.jsonl → gauge name, help).
_GAUGES = {
    "reward_mean": ("rollmesh_trainer_reward_mean", "Mean trajectory reward of the last step's batch"),
    "clip_frac": ("rollmesh_trainer_clip_fraction_ratio", "Share of tokens whose ratio was clipped, last step"),
    "approx_kl": ("rollmesh_trainer_approx_kl", "Approximate KL(π_old || π), last step"),
    "entropy": ("rollmesh_trainer_entropy_nats", "Mean token entropy of the last step"),
    "grad_norm": ("rollmesh_trainer_grad_norm", "Gradient norm before clipping, last step"),
    "lr": ("rollmesh_trainer_learning_rate", "Learning rate of the last step"),
    "ratio_max": ("rollmesh_trainer_importance_ratio_max", "Largest importance ratio of the last step"),
    "ratio_behavior_mean": ("rollmesh_trainer_behavior_ratio_mean", "Mean π/μ (current over sampling), last step"),
    "mismatch_fresh_mean": (
        "rollmesh_trainer_logprob_mismatch_fresh_nats",
        "Mean |log μ − log π_prox| over tokens sampled by the trainer's current weights (engine vs trainer numerics)",
    ),
    "mismatch_stale_mean": (
        "rollmesh_trainer_logprob_mismatch_stale_nats",
        "Mean |log μ − log π_prox| over tokens sampled by older weights (numerics plus staleness)",
    ),
    "kl_behavior_stale": (
        "rollmesh_trainer_stale_policy_kl_nats",
        "KL(μ ‖ π_prox) over tokens sampled by older weights, last step: how far the policy moved since they "
        "were sampled (the quickstart learned under about 0.3 nats; the trainer warns above 1; docs/losses.md)",
    ),
}


# A step's numbers per task domain (trainer/batch.py: domain_stats) → gauge name, help; label: domain.
_DOMAIN_GAUGES = {
    "groups": ("rollmesh_trainer_domain_groups", "Groups of the domain in the last step's batch"),
    "reward_mean": ("rollmesh_trainer_domain_reward_mean", "Mean reward of the domain's answers, last step"),
    "accuracy": ("rollmesh_trainer_domain_accuracy_ratio", "Share of the domain's answers with reward >= 1, last step"),
    "response_tokens": ("rollmesh_trainer_domain_response_tokens", "Mean generated tokens per answer, last step"),
    "truncated_share": (
        "rollmesh_trainer_domain_truncated_ratio",
        "Share of the domain's answers cut at max_new_tokens, last step",
    ),
    "staleness_mean": (
        "rollmesh_trainer_domain_staleness_versions",
        "Mean staleness of the domain's answers, last step",
    ),
}


def loss_terms(metrics: dict) -> dict[str, float]:
    """The loss and its parts in a step's metrics: ``loss``, ``pg_loss``, ``kl_loss``, ..."""
    return {
        ("total" if k == "loss" else k.removesuffix("_loss")): float(v)
        for k, v in metrics.items()
        if k == "loss" or k.endswith("_loss")
    }


class TrainerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.steps = Counter("rollmesh_trainer_steps", "Optimizer steps taken", registry=r)
        self.version = Gauge("rollmesh_trainer_policy_version", "Policy version of the trainer's weights", registry=r)
        self.last_step = Gauge(
            "rollmesh_trainer_last_step_timestamp_seconds", "Unix time the last step finished", registry=r
        )
        self.last_step.set(time.time())  # a trainer that never steps goes stale from its start
        self.step_seconds = histogram(
            r, "rollmesh_trainer_step_duration_seconds", "Wall time of one step, waiting included", SLOW_BUCKETS_S
        )
        self.phase = Counter(
            "rollmesh_trainer_phase_seconds", "Seconds spent in each phase of a step", ["phase"], registry=r
        )
        init_labels(self.phase, *PHASES)
        self.tokens = Counter("rollmesh_trainer_tokens", "Tokens trained on (loss mask)", registry=r)
        self.tokens_per_s = Gauge(
            "rollmesh_trainer_tokens_per_second", "Train tokens per second of compute, last step", registry=r
        )
        self.trajectories = Counter("rollmesh_trainer_trajectories", "Trajectories trained on", registry=r)
        self.loss = Gauge("rollmesh_trainer_loss", "Loss terms of the last step", ["term"], registry=r)
        init_labels(self.loss, "total", "pg")
        self.gauges = {k: Gauge(name, doc, registry=r) for k, (name, doc) in _GAUGES.items()}
        self.domain_gauges = {k: Gauge(name, doc, ["domain"], registry=r) for k, (name, doc) in _DOMAIN_GAUGES.items()}
        self._domains: set[str] = set()  # every domain a step has trained
        self.domain_tokens = Counter(
            "rollmesh_trainer_domain_tokens", "Generated tokens trained on, by domain", ["domain"], registry=r
        )
        self.staleness = histogram(
            r,
            "rollmesh_trainer_staleness_versions",
            "Trainer version minus a trajectory's start version at training",
            VERSION_BUCKETS,
        )
        self.staleness_max = Gauge(
            "rollmesh_trainer_staleness_max_versions", "Largest staleness in the last step's batch", registry=r
        )
        self.update_seconds = histogram(
            r,
            "rollmesh_trainer_weight_update_duration_seconds",
            "Publishing one version: export to resume",
            SLOW_BUCKETS_S,
        )
        self.update_bytes = Counter(
            "rollmesh_trainer_weight_update_bytes", "Bytes of weights published to the engines", registry=r
        )
        self.update_failures = Counter(
            "rollmesh_trainer_weight_update_failures", "Weight updates that failed, by cause", ["cause"], registry=r
        )
        init_labels(self.update_failures, *UPDATE_FAILURE_CAUSES)

    def observe_step(self, m: dict, staleness: list[int]) -> None:
        self.steps.inc()
        self.version.set(m["version"])
        self.last_step.set(time.time())
        for phase, key in (("wait_data", "time_get_s"), ("train", "time_train_s"), ("weight_sync", "time_publish_s")):
            self.phase.labels(phase).inc(m.get(key, 0.0))
        self.step_seconds.observe(sum(m.get(k, 0.0) for k in ("time_get_s", "time_train_s", "time_publish_s")))
        self.tokens.inc(m.get("tokens", 0))
        self.tokens_per_s.set(m.get("tokens", 0) / max(m.get("time_train_s", 0.0), 1e-9))
        self.trajectories.inc(len(staleness))
        for term, value in loss_terms(m).items():
            self.loss.labels(term).set(value)
        for key, gauge in self.gauges.items():
            if key in m:
                gauge.set(m[key])
        present = set()
        for key, value in m.items():
            if key.startswith("domain/"):
                _, domain, what = key.split("/", 2)
                present.add(domain)
                if what == "tokens":
                    self.domain_tokens.labels(domain).inc(value)
                elif what in self.domain_gauges:
                    self.domain_gauges[what].labels(domain).set(value)
        for domain in self._domains - present:  # not in this batch: its share is 0, not what it last was
            self.domain_gauges["groups"].labels(domain).set(0)
        self._domains |= present
        for s in staleness:
            self.staleness.observe(s)
        self.staleness_max.set(max(staleness, default=0))


class TrainerObserver(TrainObserver):
    """The training loop's observer on rank 0: each step to ``metrics.jsonl`` (and trackers) and
    to Prometheus; weight updates' seconds, bytes and failures to Prometheus."""

    def __init__(self, log: MetricsLog | None, prom: TrainerMetrics) -> None:
        self.log, self.prom = log, prom

    def step_done(self, metrics: dict, staleness: list[int]) -> None:
        if self.log is not None:
            self.log.write(metrics)
        self.prom.observe_step(metrics, staleness)

    def checkpoint_done(self, seconds: float) -> None:
        self.prom.phase.labels("checkpoint").inc(seconds)

    def update_done(self, seconds: float, location: str) -> None:
        self.prom.update_seconds.observe(seconds)
        self.prom.update_bytes.inc(_dir_bytes(location))

    def update_failed(self, cause: str) -> None:
        self.prom.update_failures.labels(cause).inc()


def _dir_bytes(path: str) -> int:
    """Size of an exported weight directory (0 for an engine that exports nothing)."""
    p = Path(path) if path else None
    if p is None or not p.exists():
        return 0
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
