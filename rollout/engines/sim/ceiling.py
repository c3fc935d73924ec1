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
    rng = random.Random(seed)
    t, version = 0.0, 0
    finished = in_flight = 0  # groups, as the controller counts them
    running: list[list[_Seq]] = [[] for _ in range(engines)]
    waiting: list[_Seq] = []
    groups: dict[int, _Group] = {}
    buffer: list[tuple[int, int, float]] = []  # (group, start version, tokens), completion order
    trainer_busy_until, loading_until, loading = None, 0.0, False
    step_times: list[float] = []
    trained: list[float] = []  # tokens of each step's batch
    busy_slot_s = measured_s = 0.0
    next_group = 0

    def admit() -> None:
        nonlocal in_flight, next_group
        for _ in range(admission_capacity(async_ratio, version, groups_per_step, finished, in_flight)):
            seqs = [_Seq(next_group, _length(rng, sim, max_new_tokens)) for _ in range(group_size)]
            groups[next_group] = _Group(group_size, tokens=sum(s.remaining for s in seqs))
            waiting.extend(seqs)
            in_flight += 1
            next_group += 1

    def schedule() -> None:
        while waiting:
            e = min(range(engines), key=lambda i: len(running[i]))
            if len(running[e]) >= max_running:
                return
            running[e].append(waiting.pop(0))

    def abort_stale() -> None:
        """As the EnvManager does: stop groups a finished member shows can never be trained on."""
        nonlocal in_flight
        doomed = {gid for gid, g in groups.items() if group_is_stale(g.start_versions, version, async_ratio)}
        if doomed:
            for e in range(engines):
                running[e] = [s for s in running[e] if s.group not in doomed]
            waiting[:] = [s for s in waiting if s.group not in doomed]
            for gid in doomed:
                del groups[gid]
            in_flight -= len(doomed)

    def rate(e: int) -> float:  # tokens/s of each sequence on engine e
        return 0.0 if loading or not running[e] else 1.0 / sim.step_s(len(running[e]))

    def try_train() -> None:
        nonlocal trainer_busy_until, finished
        fresh = [b for b in buffer if b[1] >= version - async_ratio]
        finished -= len(buffer) - len(fresh)  # stale groups are dropped: their slots return
        buffer[:] = fresh
        if len(buffer) >= groups_per_step:
            batch, buffer[:] = buffer[:groups_per_step], buffer[groups_per_step:]
            tokens = sum(b[2] for b in batch)
            trained.append(tokens)
            trainer_busy_until = t + trainer.step_overhead_s + tokens / trainer.train_tokens_per_s

    admit()
    schedule()
    while len(step_times) < warmup + steps:
        for e in range(engines):  # a sequence's version is the one its first token is decoded at
            if rate(e) > 0:
                for s in running[e]:
                    if s.start_version is None:
                        s.start_version = version
        candidates = [min(s.remaining for s in running[e]) / rate(e) for e in range(engines) if rate(e) > 0]
        if loading:
            candidates.append(max(0.0, loading_until - t))
        if trainer_busy_until is not None:
            candidates.append(max(0.0, trainer_busy_until - t))
        if not candidates:
            raise RuntimeError("the model stalled: no decoding, no training, no load in progress")
        dt = min(candidates)
        if len(step_times) >= warmup:
            busy_slot_s += dt * sum(len(r) for e, r in enumerate(running) if rate(e) > 0)
            measured_s += dt
        for e in range(engines):
            r = rate(e)
            for s in running[e]:
                s.remaining -= dt * r
        t += dt
        for e in range(engines):
            done = [s for s in running[e] if s.remaining <= 1e-6]
            running[e] = [s for s in running[e] if s.remaining > 1e-6]
            for s in done:
                g = groups[s.group]
                g.start_versions.append(s.start_version)
                g.members -= 1
                if g.members == 0:
                    buffer.append((s.group, min(g.start_versions), g.tokens))
                    del groups[s.group]
                    in_flight -= 1
                    finished += 1
        if trainer_busy_until is not None and t >= trainer_busy_until - 1e-9:
            trainer_busy_until = None
            loading_until = t + sim.weight_load_s  # engines paused while the new weights load
            loading = True
        if loading and t >= loading_until - 1e-9:
            loading = False
            version += 1  # committed: the new version is served and admission moves on
            step_times.append(t)
            abort_stale()
        if trainer_busy_until is None and not loading:
            try_train()
        admit()
        schedule()
    measured = step_times[warmup:]
    step_s = (measured[-1] - step_times[warmup - 1]) / len(measured)
    tokens = sum(trained[warmup:]) / max(1, len(trained[warmup:]))
    ideal = ideal_step_s(
        tokens,
        tokens / trainer.train_tokens_per_s + trainer.step_overhead_s,
        sim,
        engines=engines,
        max_running=max_running,
    )
    return {
        "step_s": step_s,
        "engine_occupancy": busy_slot_s / max(1e-9, measured_s) / (engines * max_running),
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
