"""The EnvManager's Prometheus metrics: episodes, groups, and where an episode spends its time."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Summary
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rollout.envs.remote import ProviderPool
from rollout.loop import DROP_CAUSES
from rollout.ports import GroupOutcome, RolloutObserver
from sample_buffer.trajectory import FINISH_REASONS, FinishReason, Trajectory
from services.metrics import LATENCY_BUCKETS_S, SLOW_BUCKETS_S, TOKEN_BUCKETS, histogram, init_labels
from services.reward.metrics import reward_families


class EnvMetrics(RolloutObserver):
    """The rollout loop's observer: what it reports becomes Prometheus metrics."""

    def __init__(
        self,
        env: str,
        stats: Callable[[], dict] | None = None,
        pools: tuple[ProviderPool, ...] = (),
        domains: tuple[str, ...] = (),
    ) -> None:
        self.env, self.pools = env, pools  # the providers of remote environments (a pool per remote domain)
        self.reward_source = None  # a reward that counts its faults (reward workers, the code sandbox)
        self.domain_rewards: dict[str, object] = {}  # each named domain's reward, where it counts its faults
        self.registry = r = CollectorRegistry()
        self._domain_metrics(r, domains)
        self.episodes = Counter(
            "rollmesh_env_episodes", "Episodes ended, by env and finish reason", ["env", "finish"], registry=r
        )
        for finish in FINISH_REASONS:
            self.episodes.labels(env, finish)
        self.groups = Counter("rollmesh_env_groups", "Groups ended, by result", ["result"], registry=r)
        init_labels(self.groups, *GroupOutcome)
        self.trajectory_tokens = Counter(
            "rollmesh_env_generated_tokens",
            "Generated tokens of every ended episode (stale groups' included)",
            ["env"],
            registry=r,
        )
        self.stale_tokens = Counter(
            "rollmesh_env_stale_tokens",
            "Generated tokens of groups stopped as staler than the bound (never trained)",
            ["env"],
            registry=r,
        )
        self.generate_retries = Counter(
            "rollmesh_env_generate_retries",
            "Generation calls retried after a transient LLMProxy failure, by status",
            ["code"],
            registry=r,
        )
        self.members_dropped = Counter(
            "rollmesh_env_members_dropped",
            "Group members left out of their group (rollout.faulty_members), by cause",
            ["cause"],
            registry=r,
        )
        init_labels(self.members_dropped, *DROP_CAUSES)
        self.dropped_tokens = Counter(
            "rollmesh_env_dropped_member_tokens",
            "Tokens the dropped members had generated (never trained), by cause",
            ["cause"],
            registry=r,
        )
        init_labels(self.dropped_tokens, *DROP_CAUSES)
        # Redundant rollout's bias toward short episodes, visible: kept members' lengths against what the
        # cancelled ones had generated when they were cancelled.
        self.member_tokens = histogram(
            r,
            "rollmesh_env_member_generated_tokens",
            "Generated tokens per member: kept (put in the buffer) or "
            "redundant (cancelled when its group was full; so far)",
            TOKEN_BUCKETS,
            labels=["fate"],
        )
        init_labels(self.member_tokens, "kept", "redundant")
        self.timeouts = Counter(
            "rollmesh_env_timeouts",
            "Episodes ended by a missed deadline, by the budget it was (step, generation, episode, reset)",
            ["budget"],
            registry=r,
        )
        init_labels(self.timeouts, "step", "generation", "episode", "reset")
        self.turns = Counter("rollmesh_env_turns", "Turns of ended episodes", registry=r)
        self.turns_over_target = Counter(
            "rollmesh_env_turns_over_target", "Turns longer than episode.latency_penalty.target_s", registry=r
        )
        self.env_errors = Counter(
            "rollmesh_env_errors",
            "Episodes ended as env_error, by kind (a provider's: unreachable, garbage, refused, "
            "observation, action; a local environment's: raised; context: the conversation outgrew the "
            "model's context and the engine refused the next turn; workflow: a custom workflow raised or broke "
            "a rule)",
            ["kind"],
            registry=r,
        )
        self.reward = Summary("rollmesh_env_trajectory_reward", "Reward of each ended episode", ["env"], registry=r)

        def hist(name: str, doc: str, buckets=LATENCY_BUCKETS_S):
            h = histogram(r, name, doc, buckets, labels=["env"])
            h.labels(env)
            return h

        self.step = hist("rollmesh_env_step_latency_seconds", "One environment step (reward included)")
        self.reward_latency = hist("rollmesh_env_reward_latency_seconds", "One reward-function call")
        self.generation = hist("rollmesh_env_generation_latency_seconds", "One turn's generation, as the env waits")
        self.episode = hist("rollmesh_env_episode_duration_seconds", "Reset to the end of an episode", SLOW_BUCKETS_S)
        self.group = hist("rollmesh_env_group_duration_seconds", "Admission to the buffer, one group", SLOW_BUCKETS_S)
        for m in (self.trajectory_tokens, self.stale_tokens, self.reward):
            m.labels(env)
        self.stats = stats  # () -> {"running_episodes": n, "workers": n}, read at scrape time
        r.register(self)

    def _domain_metrics(self, r: CollectorRegistry, domains: tuple[str, ...]) -> None:
        """What a multi-domain run tracks per domain (``domain`` label; a run of one task has none)."""
        self.domain_episodes = Counter(
            "rollmesh_env_domain_episodes",
            "Episodes ended, by domain and finish reason (finish=length: truncated)",
            ["domain", "finish"],
            registry=r,
        )
        self.domain_reward = Summary(
            "rollmesh_env_domain_reward", "Reward of each ended episode, by domain", ["domain"], registry=r
        )
        self.domain_tokens = Counter(
            "rollmesh_env_domain_generated_tokens",
            "Generated tokens of ended episodes, by domain",
            ["domain"],
            registry=r,
        )
        self.domain_groups = Counter(
            "rollmesh_env_domain_groups",
            "Groups ended, by domain and result (put, filtered, stale, failed)",
            ["domain", "result"],
            registry=r,
        )
        self.domain_episode_s = histogram(
            r,
            "rollmesh_env_domain_episode_duration_seconds",
            "Reset to the end of an episode, by domain",
            SLOW_BUCKETS_S,
            labels=["domain"],
        )
        for d in domains:  # each series exports 0 before its first event
            for finish in FINISH_REASONS:
                self.domain_episodes.labels(d, finish)
            for outcome in GroupOutcome:
                self.domain_groups.labels(d, outcome)
            self.domain_reward.labels(d)
            self.domain_tokens.labels(d)
            self.domain_episode_s.labels(d)

    def collect(self):
        if self.domain_rewards:
            failures = CounterMetricFamily(
                "rollmesh_env_domain_reward_failures",
                "Scores cut to 0 by a fault of the verifier, by domain and cause",
                labels=["domain", "cause"],
            )
            for domain, reward in sorted(self.domain_rewards.items()):
                for cause, n in sorted(reward.failures.items()):
                    failures.add_metric([domain, cause], n)
            yield failures
        if self.stats is None:
            return
        s = self.stats()
        yield GaugeMetricFamily("rollmesh_env_running_episodes", "Episodes in progress", value=s["running_episodes"])
        yield GaugeMetricFamily("rollmesh_env_workers", "Workers of this pool", value=s["workers"])
        if self.reward_source is not None:
            yield from reward_families(self.reward_source, "rollmesh_env")
        if self.pools:
            up = sum(m.up for pool in self.pools for m in pool.members)
            yield GaugeMetricFamily("rollmesh_env_providers_up", "Environment providers in rotation", value=up)
            events = CounterMetricFamily(
                "rollmesh_env_provider_events",
                "Provider calls failed by kind (failed_*), providers marked down and back up",
                labels=["event"],
            )
            counts: dict[str, int] = {}
            for pool in self.pools:
                for event, n in pool.counters.items():
                    counts[event] = counts.get(event, 0) + n
            for event, n in sorted(counts.items()):
                events.add_metric([event], n)
            yield events
            yield CounterMetricFamily(
                "rollmesh_env_invalid_actions",
                "Episodes ended by an action the environment refused as invalid (the policy's, scored "
                "env.invalid_action_reward; the provider kept in rotation)",
                value=counts.get("invalid_action", 0),
            )

    def timed_reward(self, reward_fn: Callable) -> Callable:
        """``reward_fn`` that records each call's latency."""
        hist = self.reward_latency.labels(self.env)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return reward_fn(*args, **kwargs)
            finally:
                hist.observe(time.perf_counter() - t0)

        return timed

    def turn(self, env: str, generate_s: float, step_s: float | None) -> None:
        self.generation.labels(env).observe(generate_s)
        if step_s is not None:
            self.step.labels(env).observe(step_s)

    def episode_ended(self, trajectory: Trajectory, seconds: float, domain: str = "") -> None:
        if domain:
            self.domain_episodes.labels(domain, trajectory.finish_reason).inc()
            self.domain_reward.labels(domain).observe(trajectory.reward)
            self.domain_tokens.labels(domain).inc(trajectory.num_generated)
            self.domain_episode_s.labels(domain).observe(seconds)
        env = trajectory.metadata.get("env", self.env)
        self.episodes.labels(env, trajectory.finish_reason).inc()
        self.reward.labels(env).observe(trajectory.reward)
        self.trajectory_tokens.labels(env).inc(len(trajectory.behavior_logprobs))  # generated tokens
        self.episode.labels(env).observe(seconds)
        self.turns.inc(len(trajectory.metadata.get("turn_starts", ())))
        self.turns_over_target.inc(trajectory.metadata.get("turns_over_target", 0))
        if trajectory.finish_reason == FinishReason.TIMEOUT and "timeout" in trajectory.metadata:
            self.timeouts.labels(trajectory.metadata["timeout"]).inc()
        if trajectory.finish_reason == FinishReason.ENV_ERROR:
            self.env_errors.labels(trajectory.metadata.get("error_kind", "raised")).inc()

    def group_ended(self, outcome: str, trajectories: list[Trajectory], seconds: float, domain: str = "") -> None:
        self.groups.labels(outcome).inc()
        if domain:
            self.domain_groups.labels(domain, outcome).inc()
        if outcome == GroupOutcome.PUT:
            for t in trajectories:
                self.member_tokens.labels("kept").observe(t.num_generated)
        if outcome == GroupOutcome.STALE:  # what the bound costs: generated, never trained on
            self.stale_tokens.labels(self.env).inc(sum(len(t.behavior_logprobs) for t in trajectories))
        elif outcome != GroupOutcome.FAILED:
            self.group.labels(self.env).observe(seconds)

    def member_dropped(self, cause: str, tokens: int = 0) -> None:
        self.members_dropped.labels(cause).inc()
        self.dropped_tokens.labels(cause).inc(tokens)
        if cause == "redundant":  # cancelled: a lower bound of its length (what it had generated)
            self.member_tokens.labels("redundant").observe(tokens)

    def generate_retried(self, code: str) -> None:
        self.generate_retries.labels(code).inc()
