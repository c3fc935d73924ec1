"""The best any implementation of rollmesh's rules could do on the latency simulator.

``rollmesh bench async`` compares the real mesh with an *ideal* step time: engines always full
and training hidden. That ideal ignores a rule the mesh must keep: a group is admitted only if it
can still be trained on within ``async_ratio`` versions (AReaL's bound, ``rollout/admission.py``),
and it holds its slot until its slowest member ends. This module plays the same rules with zero
overheads (instant RPCs, no Python, perfect routing) in an event-driven model of the simulator's
engines and trainer, so the bench can say how far the real services are from what the rules allow
and how far the rules are from the ideal.

Model: ``engines`` engines of ``max_running`` slots, decode step ``SimEngineConfig.step_s(batch)``;
groups of ``group_size`` independent requests with lengths from the simulator's length model;
admission as in the controller; the trainer takes the first ``groups_per_step`` complete, fresh
groups in completion order (dropping stale ones, whose slots return), trains for the simulated
trainer's time, then pauses every engine for the weight load and bumps the version; a group that a
finished member shows to be too stale is stopped at once (``group_is_stale``), as the EnvManager does.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Protocol

from rollout.admission import admission_capacity, group_is_stale
from rollout.engines.sim.config import SimEngineConfig
from rollout.engines.sim.lengths import lognormal_sigma

# The workload ``rollmesh bench async`` runs and ``bench ceiling`` plays by default: two engines of
# 64 running requests (a 7B on an H100 each), groups of 8, responses up to 16k tokens.
SHAPE = {"engines": 2, "max_running": 64, "group_size": 8, "max_new_tokens": 16384}


class SimTrainer(Protocol):
    """The simulated trainer's throughput (``trainer/sim.py``'s config has these fields)."""

    train_tokens_per_s: float
    step_overhead_s: float


@dataclass
class _Seq:
    group: int
    remaining: float  # tokens still to generate
    start_version: int | None = None


@dataclass
class _Group:
    members: int
    start_versions: list[int] = field(default_factory=list)
    tokens: float = 0.0


def _length(rng: random.Random, sim: SimEngineConfig, max_new_tokens: int) -> float:
    lengths = sim.lengths
    draw = rng.lognormvariate(math.log(lengths.median), lognormal_sigma(lengths.median, lengths.p99))
    return float(max(1, min(round(draw), lengths.cap, max_new_tokens)))


class _Play:
    """The event-driven model: engines decoding, groups completing, the trainer training and the
    weights loading, each advanced to the next event (a sequence ending, training or a load done)."""

    def __init__(
        self, sim, trainer, engines, max_running, groups_per_step, group_size, async_ratio, max_new_tokens, rng
    ):
        self.sim, self.trainer, self.rng = sim, trainer, rng
        self.engines, self.max_running, self.group_size = engines, max_running, group_size
        self.groups_per_step, self.async_ratio, self.max_new_tokens = groups_per_step, async_ratio, max_new_tokens
        self.t, self.version = 0.0, 0
        self.finished = self.in_flight = 0  # groups, as the controller counts them
        self.running: list[list[_Seq]] = [[] for _ in range(engines)]
        self.waiting: list[_Seq] = []
        self.groups: dict[int, _Group] = {}
        self.buffer: list[tuple[int, int, float]] = []  # (group, start version, tokens), completion order
        self.trainer_busy_until: float | None = None
        self.loading_until, self.loading = 0.0, False
        self.step_times: list[float] = []
        self.trained: list[float] = []  # tokens of each step's batch
        self.busy_slot_s = self.measured_s = 0.0
        self.next_group = 0

    def admit(self) -> None:
        capacity = admission_capacity(
            self.async_ratio, self.version, self.groups_per_step, self.finished, self.in_flight
        )
        for _ in range(capacity):
            seqs = [
                _Seq(self.next_group, _length(self.rng, self.sim, self.max_new_tokens)) for _ in range(self.group_size)
            ]
            self.groups[self.next_group] = _Group(self.group_size, tokens=sum(s.remaining for s in seqs))
            self.waiting.extend(seqs)
            self.in_flight += 1
            self.next_group += 1

    def schedule(self) -> None:
        while self.waiting:
            e = min(range(self.engines), key=lambda i: len(self.running[i]))
            if len(self.running[e]) >= self.max_running:
                return
            self.running[e].append(self.waiting.pop(0))

    def abort_stale(self) -> None:
        """As the EnvManager does: stop groups a finished member shows can never be trained on."""
        doomed = {
            gid for gid, g in self.groups.items() if group_is_stale(g.start_versions, self.version, self.async_ratio)
        }
        if doomed:
            for e in range(self.engines):
                self.running[e] = [s for s in self.running[e] if s.group not in doomed]
            self.waiting[:] = [s for s in self.waiting if s.group not in doomed]
            for gid in doomed:
                del self.groups[gid]
            self.in_flight -= len(doomed)

    def rate(self, e: int) -> float:  # tokens/s of each sequence on engine e
        return 0.0 if self.loading or not self.running[e] else 1.0 / self.sim.step_s(len(self.running[e]))

    def try_train(self) -> None:
        fresh = [b for b in self.buffer if b[1] >= self.version - self.async_ratio]
        self.finished -= len(self.buffer) - len(fresh)  # stale groups are dropped: their slots return
        self.buffer[:] = fresh
        if len(self.buffer) >= self.groups_per_step:
            batch, self.buffer[:] = self.buffer[: self.groups_per_step], self.buffer[self.groups_per_step :]
            tokens = sum(b[2] for b in batch)
            self.trained.append(tokens)
            self.trainer_busy_until = self.t + self.trainer.step_overhead_s + tokens / self.trainer.train_tokens_per_s

    def next_event_s(self) -> float:
        """Seconds to the next event; a sequence's version is the one its first token is decoded at."""
        for e in range(self.engines):
            if self.rate(e) > 0:
                for s in self.running[e]:
                    if s.start_version is None:
                        s.start_version = self.version
        candidates = [
            min(s.remaining for s in self.running[e]) / self.rate(e) for e in range(self.engines) if self.rate(e) > 0
        ]
        if self.loading:
            candidates.append(max(0.0, self.loading_until - self.t))
        if self.trainer_busy_until is not None:
            candidates.append(max(0.0, self.trainer_busy_until - self.t))
        if not candidates:
            raise RuntimeError("the model stalled: no decoding, no training, no load in progress")
        return min(candidates)

    def decode(self, dt: float, measured: bool) -> None:
        """Every running sequence advanced ``dt``; the ones that end complete their groups."""
        if measured:
            self.busy_slot_s += dt * sum(len(r) for e, r in enumerate(self.running) if self.rate(e) > 0)
            self.measured_s += dt
        for e in range(self.engines):
            r = self.rate(e)
            for s in self.running[e]:
                s.remaining -= dt * r
        self.t += dt
        for e in range(self.engines):
            done = [s for s in self.running[e] if s.remaining <= 1e-6]
            self.running[e] = [s for s in self.running[e] if s.remaining > 1e-6]
            for s in done:
                g = self.groups[s.group]
                g.start_versions.append(s.start_version)
                g.members -= 1
                if g.members == 0:
                    self.buffer.append((s.group, min(g.start_versions), g.tokens))
                    del self.groups[s.group]
                    self.in_flight -= 1
                    self.finished += 1

    def train_and_load(self) -> None:
        """A finished training step starts the weight load (engines paused); a finished load commits
        the new version, and admission moves on."""
        if self.trainer_busy_until is not None and self.t >= self.trainer_busy_until - 1e-9:
            self.trainer_busy_until = None
            self.loading_until = self.t + self.sim.weight_load_s
            self.loading = True
        if self.loading and self.t >= self.loading_until - 1e-9:
            self.loading = False
            self.version += 1
            self.step_times.append(self.t)
            self.abort_stale()
        if self.trainer_busy_until is None and not self.loading:
            self.try_train()


def ceiling(
    sim: SimEngineConfig,
    trainer: SimTrainer,
    *,
    engines: int,
    max_running: int,
    groups_per_step: int,
    group_size: int,
    async_ratio: int,
    max_new_tokens: int,
    steps: int = 40,
    warmup: int = 8,
    seed: int = 0,
) -> dict:
    """Simulated seconds per step (after ``warmup``) and the engines' mean occupancy."""
    play = _Play(
        sim,
        trainer,
        engines,
        max_running,
        groups_per_step,
        group_size,
        async_ratio,
        max_new_tokens,
        random.Random(seed),
    )
    play.admit()
    play.schedule()
    while len(play.step_times) < warmup + steps:
        play.decode(play.next_event_s(), len(play.step_times) >= warmup)
        play.train_and_load()
        play.admit()
        play.schedule()
    measured = play.step_times[warmup:]
    step_s = (measured[-1] - play.step_times[warmup - 1]) / len(measured)
    tokens = sum(play.trained[warmup:]) / max(1, len(play.trained[warmup:]))
    ideal = ideal_step_s(
        tokens,
        tokens / trainer.train_tokens_per_s + trainer.step_overhead_s,
        sim,
        engines=engines,
        max_running=max_running,
    )
    return {
        "step_s": step_s,
        "engine_occupancy": play.busy_slot_s / max(1e-9, play.measured_s) / (engines * max_running),
        "tokens_per_step": tokens,
        "ideal_step_s": ideal,
        "efficiency": ideal / step_s,
    }


def ideal_step_s(tokens: float, train_s: float, sim: SimEngineConfig, *, engines: int, max_running: int) -> float:
    """The bench's ideal: a step's trained tokens decoded on always-full engines, training hidden."""
    return max(tokens / (engines * max_running / sim.step_s(max_running)), train_s)


def sweep(
    sim: SimEngineConfig,
    trainer: SimTrainer,
    *,
    engines: int,
    max_running: int,
    group_size: int,
    max_new_tokens: int,
    groups_per_step: list[int],
    async_ratios: list[int],
    steps: int = 60,
    warmup: int = 10,
    progress=None,
) -> list[dict]:
    """Every (groups_per_step, async_ratio) played in steady state: its step time, efficiency against
    the ideal and speedup over synchronous (async_ratio 0) at the same step size. Which async_ratio a
    workload needs depends on how big a step is next to what the engines decode at once (ROLL
    Flash's Table 1: small rollouts need a larger ratio); this says it for a given workload."""
    rows = []
    for gps in groups_per_step:
        sync = None
        for ratio in sorted(set(async_ratios) | {0}):
            r = ceiling(
                sim,
                trainer,
                engines=engines,
                max_running=max_running,
                groups_per_step=gps,
                group_size=group_size,
                async_ratio=ratio,
                max_new_tokens=max_new_tokens,
                steps=steps,
                warmup=warmup,
            )
            sync = sync or r
            # Groups that outlive the bound are never trained, and they are the ones with the longest
            # members: trained tokens per step below synchronous's measure that bias against length.
            row = {
                "groups_per_step": gps,
                "step_vs_slots": gps * group_size / (engines * max_running),
                "async_ratio": ratio,
                **r,
                "speedup_vs_sync": sync["step_s"] / r["step_s"],
                "trained_tokens_vs_sync": r["tokens_per_step"] / sync["tokens_per_step"],
            }
            if ratio in async_ratios:
                rows.append(row)
            if progress:
                progress(row)
    return rows
