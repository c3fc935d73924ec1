"""What a reward counts, as Prometheus families; and the reward service's own metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily

from services.metrics import SLOW_BUCKETS_S, histogram, init_labels

# ok, or why a score is 0: timeout (here or the verifier's own bound), raised, busy (no free verifier
# before the caller's deadline), fault (any other cause the verifier contained: crashed, memory, ...;
# by cause in rollmesh_reward_reward_failures_total)
SCORE_OUTCOMES = ("ok", "timeout", "raised", "busy", "fault")


def reward_families(reward, prefix: str) -> list:
    """What a reward counts: its faults (reward workers: raised, timeout, crashed; the code
    sandbox: timeout, memory, output, killed, sandbox; the judge: timeout, error, unparsed; the
    service's client: timeout, unreachable, error) and, for the code reward, its runs.
    ``prefix``: the service's (``rollmesh_env`` in an EnvManager, ``rollmesh_reward`` in the service)."""
    failures = CounterMetricFamily(
        f"{prefix}_reward_failures",
        "Scores cut to 0 by a fault of the verifier or the program it ran, by cause",
        labels=["cause"],
    )
    for cause, n in sorted(reward.failures.items()):
        failures.add_metric([cause], n)
    families = [failures]
    if hasattr(reward, "outcomes"):
        runs = CounterMetricFamily(f"{prefix}_code_runs", "Sandboxed runs of answers, by outcome", labels=["outcome"])
        for outcome, n in sorted(reward.outcomes.items()):
            runs.add_metric([outcome], n)
        families += [
            runs,
            CounterMetricFamily(
                f"{prefix}_code_sandbox_seconds", "Wall seconds spent in the sandbox", value=reward.sandbox_seconds
            ),
            CounterMetricFamily(
                f"{prefix}_code_adaptive_cuts",
                "Runs stopped by the adaptive timeout below its fixed limit",
                value=reward.adaptive_cuts,
            ),
        ]
    return families


class RewardMetrics:
    """The reward service's: scores by outcome, their seconds, the calls in progress, and what
    the hosted reward counts (``reward_families``)."""

    def __init__(self, reward) -> None:
        self.registry = r = CollectorRegistry()
        self.scores = Counter(
            "rollmesh_reward_scores",
            "Score calls answered, by outcome (all but ok score 0: "
            "timeout, raised, busy, or another fault the verifier contained)",
            ["outcome"],
            registry=r,
        )
        init_labels(self.scores, *SCORE_OUTCOMES)
        self.seconds = histogram(
            r, "rollmesh_reward_score_seconds", "One score, the wait for a free slot included", SLOW_BUCKETS_S
        )
        self.in_flight = Gauge("rollmesh_reward_in_flight", "Score calls being worked on or waiting", registry=r)
        if hasattr(reward, "failures"):
            r.register(_Families(reward))


class _Families:
    def __init__(self, reward) -> None:
        self.reward = reward

    def collect(self):
        yield from reward_families(self.reward, "rollmesh_reward")


class SummedRewards:
    """Several rewards' counts as one: a multi-domain EnvManager's unlabelled families (each domain's
    faults also have a ``domain`` label of their own)."""

    _CODE = ("outcomes", "sandbox_seconds", "adaptive_cuts")  # only a code reward has these

    def __init__(self, rewards: list) -> None:
        self.rewards = rewards

    @property
    def failures(self) -> dict[str, int]:
        return _summed([r.failures for r in self.rewards])

    def __getattr__(self, name: str):
        code = [r for r in self.rewards if hasattr(r, name)]
        if name not in self._CODE or not code:  # hasattr() is False: no code families
            raise AttributeError(name)
        values = [getattr(r, name) for r in code]
        return _summed(values) if name == "outcomes" else sum(values)


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, n in c.items():
            out[k] = out.get(k, 0) + n
    return out
