"""`rollmesh bench chaos`: kill every service once, mid-run, and account for every group.

A `rollmesh run` of the quickstart on the tiny model with the Redis buffer; each service in turn
(engine, LLMProxy, AsyncController, SampleBuffer, redis-server, EnvManager, trainer) gets SIGKILL
at a random moment after every ``steps_between`` steps. `rollmesh run` restarts its own processes;
redis-server, which it does not own, is restarted here as a node's init system would.

Reported per service: seconds from the kill to the next trained step (0 when a step under way
carries on without it), and to the moment it serves again (its /metrics answers). The next kill
waits for that, so each recovery is timed alone. For the run: groups trained
twice (the same group id in two steps of ``metrics.jsonl``) and groups lost: every group the buffer
stored must be consumed (acked), dropped with a reason, or still in the buffer; groups of steps a
killed trainer trained but lost before its checkpoint (``lost_steps.jsonl``) are listed apart.
Then the slowdown against the same run undisturbed. With ``teacher``, the run distills from a
teacher (the policy's own model, on its own engine and LLMProxy: on-policy distillation), and its
engine and proxy are killed too: groups wait for it within their deadline (or are dropped, counted),
and rollout goes on.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from launch.bench import BadOption

SERVICES = ("engine", "llm-proxy", "controller", "sample-buffer", "redis-server", "env-manager", "trainer")
TEACHER_SERVICES = ("teacher-self-engine", "teacher-self-proxy")  # with ``teacher``: its engine and LLMProxy
REDIS = "redis-server"
# Found by the port on their command line (the one their Prometheus target names): a run with a teacher
# has two processes of each kind.
_BY_PORT = {"engine": "engine", "llm-proxy": "proxy", "teacher-self-engine": "engine", "teacher-self-proxy": "proxy"}


def _command(model: str, run_dir: Path, redis_url: str, steps: int, teacher: bool = False) -> list[str]:
    overrides = [
        f"model_path={model}",
        f"train_loop.run_dir={run_dir}",
        f"train_loop.steps={steps}",
        "run.heldout_path=null",
        "train_loop.checkpoint_every=2",
        "controller.groups_per_step=2",
        "buffer.filter_zero_variance=false",  # a random model's groups mostly score all 0: keep them
        "train_loop.get_timeout_s=20",
        "controller.update_timeout_s=30",
        "buffer.backend=redis",
        f"buffer.redis_url={redis_url}",
        f"buffer.key_prefix=chaos-{run_dir.name}",
    ]
    if teacher:
        overrides += [f"teachers=[{{name: self, model_path: {model}}}]", "env_manager.teacher=self"]
    cmd = [sys.executable, "-m", "launch.cli", "run", "examples/quickstart.yaml"]
    return cmd + [a for o in overrides for a in ("--set", o)]


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def _wait(what: str, done, proc: subprocess.Popen, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := done()) is not None:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: the run exited with {proc.returncode}")
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


def _kill(service: str, run_dir: Path, redis) -> None:
    if service == REDIS:
        redis.kill9()
        time.sleep(1.0)  # down for a moment, then back on its port with its append-only file
        redis.start()
        return
    pattern = f"launch.cli serve {service} .*train_loop.run_dir={run_dir}"
    if service in _BY_PORT:
        port = _target(service, run_dir).rsplit(":", 1)[1]
        kind = _BY_PORT[service]
        key = "engine.port" if kind == "engine" else "proxy.metrics_port"
        pattern = f"launch.cli serve {'engine' if kind == 'engine' else 'llm-proxy'} .*{key}={port}( |$)"
    pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    if not pids:
        raise RuntimeError(f"no {service} process of this run to kill")
    os.kill(int(pids[0]), signal.SIGKILL)


def _target(service: str, run_dir: Path) -> str:
    """``service``'s host:port as the run lists it for Prometheus (an engine's: its API's)."""
    targets = json.loads((run_dir / "prometheus_targets.json").read_text())
    [address] = [t["targets"][0] for t in targets if t["labels"]["job"] == service][:1]
    return address


def _serving(service: str, run_dir: Path, http) -> float | None:
    """The time if ``service`` answers again (its /metrics, as listed for Prometheus), asked with the
    ``httpx.Client`` ``http`` (one for every poll: each new one builds an SSL context, ~70 ms)."""
    address = _target(service, run_dir)
    try:
        return time.time() if http.get(f"http://{address}/metrics").status_code == 200 else None
    except httpx.HTTPError:
        return None


def _run(
    model: str,
    run_dir: Path,
    redis,
    total: int,
    kills: list[str],
    steps_between: int,
    pause,
    progress,
    teacher: bool = False,
) -> tuple[dict, dict, float, str]:
    """One run; kills ``kills`` in order, each once the last victim serves again and
    ``steps_between`` more steps were trained, ``pause()`` seconds after that step ends. Returns
    (seconds from kill to next step, seconds from kill to serving again, per service), wall, output."""
    log = open(run_dir.parent / f"{run_dir.name}.out", "w+")  # noqa: SIM115 (read back below)
    t0 = time.time()
    cmd = _command(model, run_dir, redis.url, total, teacher)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    recovery: dict[str, float] = {}
    serving: dict[str, float] = {}
    http = httpx.Client(timeout=1.0)
    try:
        for service in kills:
            # Each kill meets a whole mesh: the last victim serves again, and steps went on since.
            at = len(_steps(run_dir)) + steps_between
            _wait(f"step {at}", lambda at=at: len(_steps(run_dir)) >= at or None, proc, 300)
            time.sleep(pause())  # within a step: mid-generation, mid-update or mid-train
            t_kill = time.time()
            _kill(service, run_dir, redis)  # redis-server: restarted here, serving once this returns
            seen = {"serving": time.time()} if service == REDIS else {}
            progress(f"killed {service} after step {len(_steps(run_dir))} of {total}")

            def both(t_kill=t_kill, service=service, seen=seen):
                """Watch for the next step and the service serving again at once: each at its moment."""
                if "step" not in seen and (later := [s["wall"] for s in _steps(run_dir) if s["wall"] > t_kill]):
                    seen["step"] = min(later)
                if "serving" not in seen and (t := _serving(service, run_dir, http)) is not None:
                    seen["serving"] = t
                return True if len(seen) == 2 else None

            _wait(f"a step after killing {service}, and {service} serving again", both, proc, 300)
            recovery[service] = round(seen["step"] - t_kill, 1)
            serving[service] = round(max(0.0, seen["serving"] - t_kill), 1)
            progress(f"  next step {recovery[service]} s after the kill; serving again after {serving[service]} s")
        proc.wait(600)
    finally:
        http.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log.seek(0)
    out = log.read()
    log.close()
    if proc.returncode != 0:
        raise RuntimeError(f"rollmesh run exited with {proc.returncode}:\n{out[-3000:]}")
    return recovery, serving, time.time() - t0, out


def _accounting(run_dir: Path, redis_url: str) -> dict:
    """Where every group the buffer stored went, from the buffer's counters (kept in Redis) and the
    group ids each step recorded."""
    import asyncio

    from sample_buffer.backends import make_buffer
    from sample_buffer.config import BufferConfig

    trained = Counter(g for s in _steps(run_dir) for g in s["group_ids"])
    lost_path = run_dir / "lost_steps.jsonl"
    lost_with_trainer = (
        [g for x in lost_path.read_text().splitlines() for g in json.loads(x)["group_ids"]]
        if lost_path.exists()
        else []
    )

    async def stats() -> dict:
        buffer = make_buffer(BufferConfig(backend="redis", redis_url=redis_url, key_prefix=f"chaos-{run_dir.name}"))
        try:
            return await buffer.stats()
        finally:
            await buffer.close()

    s = asyncio.run(stats())
    accounted = s["consumed"] + s["dropped_stale"] + s["dropped_corrupt"] + s["depth"] + s["in_flight"]
    return {
        "groups_stored": s["put"],
        "groups_consumed": s["consumed"],
        "groups_dropped": {k: s[k] for k in s if k.startswith("dropped_")},
        "groups_left_in_buffer": s["depth"] + s["in_flight"],
        "groups_lost": s["put"] - accounted,
        "groups_trained": sum(trained.values()),
        "groups_trained_twice": sum(n - 1 for n in trained.values() if n > 1),
        "groups_trained_by_a_killed_trainer_before_its_checkpoint": len(lost_with_trainer),
    }


def run(
    model_path: str,
    services: list[str] | None = None,
    steps_between: int = 2,
    seed: int = 0,
    baseline: bool = True,
    progress=print,
    keep: str | None = None,
    kill_delay_s: float | None = None,
    teacher: bool = False,
) -> dict:
    """``kill_delay_s``: kill each service this long after a step ends (a fixed schedule, as the
    tests run it); default a random moment within 0.5 s, drawn from ``seed``. ``teacher``: the run
    distills from a teacher, whose engine and proxy are among the services."""
    from services.auth import AuthConfig, ensure_token
    from services.processes import RedisServer

    known = SERVICES + TEACHER_SERVICES if teacher else SERVICES
    services = list(services or known)
    unknown = [s for s in services if s not in known]
    if unknown or not services:
        raise BadOption(f"--service: choose from {', '.join(known)} (got {unknown or 'none'})")
    if steps_between < 1:
        raise BadOption(f"--steps-between: must be >= 1, got {steps_between}")
    if not (Path(model_path) / "config.json").exists():
        raise BadOption(f"--model: no model at {model_path} (make model builds models/tiny)")
    ensure_token(AuthConfig())
    # The last kill must still find steps to train: a trainer killed after its last step would just
    # exit. Kills come steps_between steps after the last victim serves again, and steps go on while
    # it recovers: at most ~3 per kill at the quickstart's async_ratio 1 (measured 1-4), so each kill
    # gets steps_between + 4 steps of room, and the undisturbed end as much again.
    steps = (steps_between + 4) * (len(services) + 1)
    rng = random.Random(seed)

    def pause() -> float:
        return rng.uniform(0.0, 0.5) if kill_delay_s is None else kill_delay_s

    with tempfile.TemporaryDirectory(prefix="rollmesh-chaos-") as d:
        tmp = Path(keep or d)  # kept: each run's output, logs and metrics
        (tmp / "redis").mkdir(parents=True)
        redis = RedisServer(tmp / "redis").start()
        try:
            undisturbed = None
            if baseline:
                progress(f"undisturbed run: {steps} steps")
                calm = (model_path, tmp / "calm", redis, steps, [], steps_between, pause, progress, teacher)
                _, _, undisturbed, _ = _run(*calm)
            progress(f"disturbed run: {steps} steps, killing {', '.join(services)}")
            run_dir = tmp / "chaos"
            recovery, serving, disturbed, out = _run(
                model_path, run_dir, redis, steps, services, steps_between, pause, progress, teacher
            )
            restarts = {s: len(re.findall(rf"^{s}(-\d+)? exited with code", out, re.M)) for s in services}
            result = {
                "steps": steps,
                "services_killed": services,
                "kill_to_next_step_s": recovery,
                "kill_to_serving_again_s": serving,
                "restarts_by_the_launcher": {s: n for s, n in restarts.items() if s != REDIS},
                **_accounting(run_dir, redis.url),
                "undisturbed_wall_s": round(undisturbed, 1) if undisturbed else None,
                "disturbed_wall_s": round(disturbed, 1),
                "slowdown": round(disturbed / undisturbed, 2) if undisturbed else None,
            }
        finally:
            redis.stop()
    return result
