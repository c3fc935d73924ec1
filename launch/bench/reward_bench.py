"""`rollmesh bench reward`: what the adaptive sandbox timeout saves, and verifier throughput.

- **Code, fixed vs adaptive timeout.** A synthetic code workload in RollPacker's shape: tasks whose
  correct answers run a task-specific time (CPU-bound, ``--base-s``, varying ±50% by answer), wrong
  answers that fail at once, and about ``--hang-share`` of answers that never end, so they run into
  the fixed limit (``--fixed-s``, RollPacker's 30 s scaled down). The same answers, in the same
  order, are scored with the fixed limit and with the adaptive one
  (min(max(T_min, λ·T_anchor), T_max)): sandbox seconds and wall seconds of each, and the correct
  answers the adaptive limit lost (it should lose none).
- **Throughput.** Sandbox runs/s of a trivial program at 1 and 2 concurrent runs, and math-verify
  scores/s in-process, in 1 and 2 reward workers (``rollout/reward_pool.py``) and in a reward
  service of 2 workers over gRPC (``services/reward``), with one score's latency there and in a
  local worker: what the service's hop costs.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

from launch.bench import BadOption

_BUSY = "import time\n_t = time.perf_counter()\nwhile time.perf_counter() - _t < {s:.4f}:\n    pass\n"


def _workload(tasks: int, per_task: int, base_s: float, hang_share: float, seed: int) -> list[tuple[str, str, str]]:
    """(kind, response, answer) in the order they are scored; kind: right, wrong, hang."""
    rng = random.Random(seed)
    items = []
    for t in range(tasks):
        cost = base_s * rng.uniform(0.3, 1.7)  # tasks differ in how long a right answer runs
        answer = json.dumps({"task_id": f"t{t}", "tests": f"assert f({t}) == {t * t}", "entry_point": None})
        for _ in range(per_task):
            u = rng.random()
            if u < hang_share:
                kind, body = "hang", "def f(x):\n    while True:\n        pass\n"
            elif u < 0.65:
                kind, body = "right", _BUSY.format(s=cost * rng.uniform(0.5, 1.5)) + "def f(x):\n    return x * x\n"
            else:
                kind, body = "wrong", "def f(x):\n    return x * x + 1\n"
            items.append((kind, f"```python\n{body}```", answer))
    rng.shuffle(items)
    return items


def _score_all(score, items, concurrency: int) -> tuple[list, float]:
    """``score(item)`` for every item, ``concurrency`` at once; and the wall seconds it took."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as ex:
        scores = list(ex.map(score, items))
    return scores, time.monotonic() - t0


def _timeouts(fixed_s: float, adaptive: bool, t_min_s: float, lam: float):
    from rollout.verifiers.adaptive_timeout import AdaptiveTimeoutConfig

    return AdaptiveTimeoutConfig(enabled=adaptive, t_min_s=min(t_min_s, fixed_s), t_max_s=fixed_s, lam=lam)


def run(
    tasks: int,
    per_task: int,
    base_s: float,
    hang_share: float,
    fixed_s: float,
    t_min_s: float,
    lam: float,
    concurrency: int,
    seed: int,
    progress,
) -> dict:
    from rollout.reward_pool import RewardPool
    from rollout.rewards import math_verify
    from rollout.verifiers.code import CodeReward, CodeRewardConfig
    from rollout.verifiers.sandbox import Sandbox, SandboxConfig

    if tasks < 1 or per_task < 1:
        raise BadOption("--tasks and --per-task must be >= 1")
    if not 0 <= hang_share < 0.65:
        raise BadOption(f"--hang-share must be in [0, 0.65), got {hang_share}")
    if not 0 < base_s < fixed_s / 3:
        raise BadOption(f"--base-s must be in (0, --fixed-s / 3): a right answer must fit in time, got {base_s}")
    items = _workload(tasks, per_task, base_s, hang_share, seed)
    kinds = [k for k, _, _ in items]
    out: dict = {
        "answers": len(items),
        "hanging": kinds.count("hang"),
        "right": kinds.count("right"),
        "fixed_timeout_s": fixed_s,
        "lam": lam,
        "t_min_s": t_min_s,
        "concurrency": concurrency,
    }
    results = {}
    for mode in ("fixed", "adaptive"):
        sandbox = SandboxConfig(max_concurrent=concurrency)
        reward = CodeReward(
            CodeRewardConfig(sandbox=sandbox, timeout=_timeouts(fixed_s, mode == "adaptive", t_min_s, lam))
        )
        progress(f"code, {mode} timeout: {len(items)} answers, {out['hanging']} never end ...")
        scores, wall = _score_all(lambda it, reward=reward: reward(it[1], it[2]), items, concurrency)
        results[mode] = scores
        out |= {
            f"{mode}_sandbox_s": round(reward.sandbox_seconds, 2),
            f"{mode}_wall_s": round(wall, 2),
            f"{mode}_correct": int(sum(scores)),
            f"{mode}_timeouts": reward.failures["timeout"],
        }
        if mode == "adaptive":
            out["adaptive_cuts"] = reward.adaptive_cuts
        progress(f"  {wall:.1f} s wall, {reward.sandbox_seconds:.1f} sandbox s, {int(sum(scores))} correct")
    out["correct_lost_by_adaptive"] = sum(f == 1.0 and a == 0.0 for f, a in zip(results["fixed"], results["adaptive"]))
    out["sandbox_s_saved_share"] = round(1 - out["adaptive_sandbox_s"] / out["fixed_sandbox_s"], 3)
    out["wall_speedup_adaptive"] = round(out["fixed_wall_s"] / out["adaptive_wall_s"], 2)

    for n in (1, 2):
        box = Sandbox(SandboxConfig(max_concurrent=n))
        k = 40
        _, wall = _score_all(lambda _, box=box: box.run("print(1)", 5), range(k), n)
        out[f"sandbox_runs_per_s_{n}"] = round(k / wall, 1)
        progress(f"sandbox, {n} at once: {k / wall:.1f} runs/s")

    answers = [(f"The answer is $\\frac{{{i}}}{{{i + 1}}}$.", f"{i}/{i + 1}") for i in range(200)]
    math_verify("1", "1")  # its first call builds the parser: not timed
    t0 = time.monotonic()
    assert all(math_verify(r, a) == 1.0 for r, a in answers)  # in-process, as an environment without workers
    out["math_verify_per_s_inline"] = round(len(answers) / (time.monotonic() - t0), 1)
    for n in (1, 2):
        pool = RewardPool("math_verify", workers=n, timeout_s=30)
        try:
            _score_all(lambda _, pool=pool: pool("1", "1"), range(n), n)  # the workers start: not timed
            scores, wall = _score_all(lambda it, pool=pool: pool(*it), answers, n)
        finally:
            pool.close()
        assert all(s == 1.0 for s in scores), "math-verify disagreed with itself in a worker"
        out[f"math_verify_per_s_workers_{n}"] = round(len(answers) / wall, 1)
        progress(f"math-verify, {n} worker(s): {len(answers) / wall:.1f} scores/s")
    out |= _through_the_service(answers, progress)
    return out


def _through_the_service(answers: list[tuple[str, str]], progress) -> dict:
    """math-verify in a reward service (`rollmesh serve reward`, 2 workers) over gRPC from 4 callers,
    beside the 2 in-process workers above; and one score's latency, one caller, each way."""
    import statistics

    from launch.config import load_config
    from rollout.reward_pool import RewardPool
    from services.auth import ensure_token
    from services.processes import start_service_process, stop_process
    from services.reward.client import RewardClient

    auth = ensure_token(load_config().auth)  # the service process inherits it
    proc, address = start_service_process(
        "reward", "reward_service", ["reward=math_verify", "workers=2", "metrics_port=0"], auth=auth
    )
    pool = RewardPool("math_verify", workers=1, timeout_s=30)
    try:
        client = RewardClient(address, timeout_s=30, auth=auth)
        _score_all(lambda _: client("1", "1"), range(4), 4)  # the service's workers start: not timed
        scores, wall = _score_all(lambda it: client(*it), answers, 4)
        assert all(s == 1.0 for s in scores), "math-verify disagreed with itself in the reward service"
        pool("1", "1")

        def latency_ms(score) -> float:
            times = []
            for r, a in answers[:50]:
                t0 = time.perf_counter()
                score(r, a)
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)

        service_ms, pool_ms = latency_ms(client), latency_ms(pool)
    finally:
        pool.close()
        stop_process(proc)
    progress(
        f"math-verify in the reward service (2 workers, 4 callers): {len(answers) / wall:.1f} scores/s; "
        f"one score {service_ms:.2f} ms vs {pool_ms:.2f} ms in a local worker"
    )
    return {
        "math_verify_per_s_service_2_workers": round(len(answers) / wall, 1),
        "score_ms_p50_service": round(service_ms, 2),
        "score_ms_p50_local_worker": round(pool_ms, 2),
    }
