"""``rollmesh bench async``: does asynchrony pay? The real mesh on the latency simulator.

Every scenario starts the real services (LLMProxy, SampleBuffer, AsyncController, EnvManager,
trainer loop) as processes, on simulated engines (``rollout/engines/sim``) and a simulated
trainer (``trainer/sim.py``) with identical resources, runs ``warmup + steps`` training steps and
measures the simulated seconds per step after the warm-up:

    sync_batch      async_ratio 0, batch rollout (generate all, then reward all), no replication
    sync_queue      async_ratio 0, queue scheduling + prompt replication
    async_1/2/4     queue scheduling + prompt replication, async_ratio 1, 2, 4

and the agentic variant (several turns, environment latency with high variance) for sync_batch
and async_2. The ideal step time is max(generation at full engines, training): every engine
always decoding ``max_running_requests`` sequences, and training fully hidden behind rollout.
Between the two sits what the admission rule itself allows: ``rollout/engines/sim/ceiling.py`` plays the same
rules with zero overhead, so each scenario also reports how close the services come to it.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import yaml

from rollout.engines.sim.ceiling import SHAPE
from services.bench import BadOption

SCENARIOS = {
    "sync_batch": {"async_ratio": 0, "scheduling": "batch", "replicate": False},
    "sync_queue": {"async_ratio": 0, "scheduling": "queue", "replicate": True},
    "async_1": {"async_ratio": 1, "scheduling": "queue", "replicate": True},
    "async_2": {"async_ratio": 2, "scheduling": "queue", "replicate": True},
    "async_4": {"async_ratio": 4, "scheduling": "queue", "replicate": True},
}
AGENTIC = ("sync_batch", "async_2")
DEFAULT_GROUPS_PER_STEP = 80  # five times the default engines' slots: see _config
# The RLVR workload's shape (what `rollmesh bench ceiling` plays when given no run config).


def agentic_groups(groups_per_step: int) -> int:
    """The agentic variant's step: see ``_config``."""
    return max(1, round(groups_per_step / 3))


def _config(
    tmp: Path, name: str, scenario: dict, agentic: bool, *, engines: int, time_scale: float, steps: int,
    tokenizer: str, suspend_mode: str = "in_place", groups_per_step: int = DEFAULT_GROUPS_PER_STEP,
) -> Path:  # fmt: skip
    dataset = tmp / "prompts.jsonl"
    if not dataset.exists():
        dataset.write_text("".join(json.dumps({"prompt": f"task {i}", "answer": ""}) + "\n" for i in range(1000)))
    # By default a step's trajectories (80 x 8) are five times what the engines decode at once (2 x 64),
    # as in production recipes (DAPO: 512 prompts x 16 on 16 GPUs). Smaller steps next to the engines
    # need a larger async_ratio: at 1x, ratio 2 reaches only ~0.5 of the ideal (`rollmesh bench ceiling`).
    group_size, max_running = SHAPE["group_size"], SHAPE["max_running"]
    if agentic:  # tool calls and sandboxes: median 5 s, p99 ~ 80 s per step, four turns
        env_args = {"turns": 4, "latency_median_s": 5.0, "latency_sigma": 1.2, "time_scale": time_scale}
        max_new_tokens = 4096
        # Four turns of up to 4,096 tokens generate ~3x an RLVR response: a third of the groups
        # makes a step of about the same tokens (and the variant's runtime like the others').
        groups_per_step = agentic_groups(groups_per_step)
    else:  # a verifier: about a second per reward
        env_args = {"turns": 1, "latency_median_s": 1.0, "latency_sigma": 0.3, "time_scale": time_scale}
        max_new_tokens = SHAPE["max_new_tokens"]
    cfg = {
        "model_path": tokenizer,
        "engine": {"type": "sim", "max_running_requests": max_running, "time_scale": time_scale},
        "proxy": {"request_timeout_s": 600},
        "buffer": {"backend": "memory", "filter_zero_variance": False},
        "controller": {
            "async_ratio": scenario["async_ratio"],
            "groups_per_step": groups_per_step,
            "update_timeout_s": 120,
            "suspend_mode": suspend_mode,
        },
        "env_manager": {
            "dataset_path": str(dataset),
            "env": {"type": "sim", **env_args},
            "group_size": group_size,
            # Enough workers for the largest bound: (4 + 1) x groups_per_step groups in flight.
            "num_workers": 5 * groups_per_step,
            "scheduling": scenario["scheduling"],
            "replicate_prompts": scenario["replicate"],
            "episode": {
                "max_turns": env_args["turns"],
                "sampling": {"max_new_tokens": max_new_tokens},
                "generation_timeout_s": 600,
                "step_timeout_s": 600,
            },
        },
        "trainer": {"type": "sim", "time_scale": time_scale},
        "train_loop": {"steps": steps, "run_dir": str(tmp / name), "checkpoint_every": 0, "get_timeout_s": 600},
        "run": {"num_engines": engines},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_scenario(config_path: Path, warmup: int) -> dict:
    """Start the mesh, train until the trainer exits, return per-step timings (simulated seconds)."""
    from rollout.engines.sim.ceiling import ideal_step_s
    from services.config import load_config
    from services.launch import stop_process
    from services.launcher import start_mesh, start_trainer

    cfg = load_config(config_path, [])
    run_dir = Path(cfg.train_loop.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    mesh = start_mesh(cfg, config_path, [], run_dir / "logs")
    trainer = None
    occupancy: list[tuple[float, float]] = []  # (wall time, sequences decoding on all engines)
    try:
        trainer = start_trainer(config_path, [], mesh, run_dir / "logs" / "trainer.log")
        limit = time.monotonic() + 900
        while trainer.poll() is None and time.monotonic() < limit:
            occupancy.append((time.time(), _running_sequences(mesh.engine_urls)))
            time.sleep(0.25)
        if trainer.returncode != 0:
            raise RuntimeError(f"trainer failed ({trainer.returncode}): see {run_dir / 'logs' / 'trainer.log'}")
        stats = _buffer_stats(mesh.buffer)
        stale_share = _stale_token_share(mesh.metrics.get("env-manager", []))
    finally:
        if trainer is not None:
            stop_process(trainer)
        mesh.stop()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scale = cfg.engine.time_scale
    measured = rows[warmup:]
    step_s = (measured[-1]["wall"] - rows[warmup - 1]["wall"]) * scale / len(measured)
    gen_tokens = sum(r["tokens"] for r in measured) / len(measured)
    train_s = sum(r["sim_train_s"] for r in measured) / len(measured)
    ideal = ideal_step_s(gen_tokens, train_s, cfg.engine, engines=cfg.run.num_engines,
                         max_running=cfg.engine.max_running_requests)  # fmt: skip
    window = [n for t, n in occupancy if t >= rows[warmup - 1]["wall"]]
    single_turn = cfg.env_manager.episode.max_turns == 1
    rules = _rules_reference(cfg, warmup, len(measured)) if single_turn else None
    return {
        # Share of the engines' decode slots busy over the measured steps (1.0 = always full).
        "engine_occupancy": round(
            sum(window) / max(1, len(window)) / (cfg.run.num_engines * cfg.engine.max_running_requests), 3
        ),
        "step_s": step_s,
        "ideal_step_s": ideal,
        "train_s": train_s,
        "generated_tokens_per_step": gen_tokens,
        "max_staleness": max(r["staleness_max"] for r in rows),
        "bound": cfg.controller.async_ratio,
        "dropped_stale": stats.get("stale", 0),
        # Generated tokens of groups the EnvManager stopped as staler than the bound (whole run).
        "stale_token_share": stale_share,
        "consumed": stats.get("consumed", 0),
        # The same rules played with zero overhead (rollout/engines/sim/ceiling.py): over the same
        # steps as measured here (mean of 20 draws), and in steady state with its efficiency against
        # the same ideal: what the admission rule itself allows.
        "rules_step_s": rules["window_step_s"] if rules else None,
        "rules_steady_step_s": rules["steady"]["step_s"] if rules else None,
        "rules_efficiency": rules["steady"]["efficiency"] if rules else None,
    }


def _rules_reference(cfg, warmup: int, steps: int) -> dict:
    from rollout.engines.sim.ceiling import ceiling

    def play(**kw) -> dict:
        return ceiling(
            cfg.engine, cfg.trainer, engines=cfg.run.num_engines,
            max_running=cfg.engine.max_running_requests, groups_per_step=cfg.controller.groups_per_step,
            group_size=cfg.env_manager.group_size, async_ratio=cfg.controller.async_ratio,
            max_new_tokens=cfg.env_manager.episode.sampling.max_new_tokens, **kw,
        )  # fmt: skip

    # A few measured steps early in a run are not steady state (the first long tails are still
    # running): compare like with like, and give the steady state too.
    window = [play(steps=steps, warmup=warmup, seed=s)["step_s"] for s in range(20)]
    return {"window_step_s": sum(window) / len(window), "steady": play(steps=200, warmup=20)}


def _scrape(url: str) -> dict[str, float]:
    """A /metrics page's samples by name (labels summed); empty when it cannot be read."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=2).text
    except httpx.HTTPError:
        return {}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def _running_sequences(engine_urls: list[str]) -> float:
    """Sequences in the engines' running batches now (paused engines count as idle)."""
    total = 0.0
    for url in engine_urls:
        values = _scrape(url)
        if values.get("rollmesh_engine_paused", 0.0) == 0:
            total += values.get("rollmesh_engine_running_requests", 0.0)
    return total


def _stale_token_share(env_manager_targets: list[str]) -> float | None:
    """Share of the EnvManagers' generated tokens (every ended episode's, stale groups' included)
    that went to groups stopped as too stale."""
    stale = generated = 0.0
    for target in env_manager_targets:
        values = _scrape(f"http://{target}")
        stale += values.get("rollmesh_env_stale_tokens_total", 0.0)
        generated += values.get("rollmesh_env_generated_tokens_total", 0.0)
    return round(stale / generated, 3) if generated else None


def _buffer_stats(address: str) -> dict:
    import asyncio

    from services.sample_buffer.client import BufferClient

    async def go():
        client = BufferClient(address, timeout_s=10)
        try:
            s = await client.stats()
            return {"consumed": s.consumed_total, **dict(s.dropped_by_reason)}
        finally:
            await client.close()

    return asyncio.run(go())


def run(
    tokenizer: str, steps: int = 6, warmup: int = 2, engines: int = SHAPE["engines"], time_scale: float = 25.0,
    scenarios: list[str] | None = None, agentic: bool = True, progress=print, keep: Path | None = None,
    suspend_mode: str = "in_place", groups_per_step: int = DEFAULT_GROUPS_PER_STEP,
) -> dict:  # fmt: skip
    """Run the scenarios; returns the table rows and the summary the JSON line reports."""
    if steps < 1 or warmup < 1 or groups_per_step < 1:
        raise BadOption("steps, warmup and groups_per_step: must be >= 1")
    names = scenarios or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise BadOption(f"scenarios: unknown {unknown}; choose from {list(SCENARIOS)}")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rollmesh-bench-async-") as d:
        tmp = Path(keep or d)  # kept: configs, logs and metrics.jsonl of every scenario
        tmp.mkdir(parents=True, exist_ok=True)
        plan = [(n, False) for n in names] + ([(n, True) for n in AGENTIC if n in names] if agentic else [])
        for name, is_agentic in plan:
            key = f"agentic_{name}" if is_agentic else name
            path = _config(tmp, key, SCENARIOS[name], is_agentic, engines=engines, time_scale=time_scale,
                           steps=warmup + steps, tokenizer=tokenizer, suspend_mode=suspend_mode,
                           groups_per_step=groups_per_step)  # fmt: skip
            t0 = time.monotonic()
            results[key] = r = run_scenario(path, warmup)
            progress(
                f"{key:20s} {r['step_s']:8.1f} s/step (ideal {r['ideal_step_s']:.1f})  staleness max "
                f"{r['max_staleness']} (bound {r['bound']})  dropped stale {r['dropped_stale']}  "
                f"stale tokens {r['stale_token_share'] or 0:.0%}  "
                f"engines {r['engine_occupancy']:.0%} full  "
                + (f"rules allow {r['rules_step_s']:.1f}  " if r["rules_step_s"] else "")
                + f"[{time.monotonic() - t0:.0f} s wall]"
            )
    return {"scenarios": results, "suspend_mode": suspend_mode, "groups_per_step": groups_per_step,
            "agentic_groups_per_step": agentic_groups(groups_per_step),
            **summarize(results)}  # fmt: skip


def summarize(results: dict[str, dict]) -> dict:
    def ratio(a: str, b: str) -> float | None:
        return round(results[a]["step_s"] / results[b]["step_s"], 3) if a in results and b in results else None

    a2 = results.get("async_2")
    return {
        "rlvr_speedup_async2_vs_sync": ratio("sync_batch", "async_2"),
        "queue_scheduling_speedup": ratio("sync_batch", "sync_queue"),
        "agentic_speedup_async2_vs_sync": ratio("agentic_sync_batch", "agentic_async_2"),
        "efficiency_vs_ideal_async2": round(a2["ideal_step_s"] / a2["step_s"], 3) if a2 else None,
        "engine_occupancy_async2": a2["engine_occupancy"] if a2 else None,
        "stale_token_share_async2": a2["stale_token_share"] if a2 else None,
        # What the admission rule allows at async_ratio 2 with zero overhead, and how close the mesh gets.
        "rules_steady_efficiency_async2": round(a2["rules_efficiency"], 3) if a2 and a2["rules_efficiency"] else None,
        "efficiency_vs_rules_async2": round(a2["rules_step_s"] / a2["step_s"], 3)
        if a2 and a2["rules_step_s"]
        else None,
        "max_observed_staleness": max((r["max_staleness"] for r in results.values()), default=None),
        "staleness_within_bound": all(r["max_staleness"] <= r["bound"] for r in results.values()),
    }
