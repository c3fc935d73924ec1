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

from launch.bench import BadOption
from launch.bench.mesh_metrics import (
    buffer_stats,
    kept_length_buckets,
    member_fates,
    running_sequences,
    stale_token_share,
)
from rollout.engines.sim.ceiling import SHAPE

SCENARIOS = {
    "sync_batch": {"async_ratio": 0, "scheduling": "batch", "replicate": False},
    "sync_queue": {"async_ratio": 0, "scheduling": "queue", "replicate": True},
    "async_1": {"async_ratio": 1, "scheduling": "queue", "replicate": True},
    "async_2": {"async_ratio": 2, "scheduling": "queue", "replicate": True},
    "async_4": {"async_ratio": 4, "scheduling": "queue", "replicate": True},
}
AGENTIC = ("sync_batch", "async_2")
# The agentic variant at async_ratio 2 with its environments in provider processes over HTTP: with and
# without injected faults (5% of steps 20x slower, 1% of episodes never answering), with and without
# redundant rollout (group_size + REDUNDANT members, the first group_size to end kept).
PROVIDER_SCENARIOS = {
    "providers": {"faults": False, "redundant": 0},
    "providers_faults": {"faults": True, "redundant": 0},
    "providers_redundant": {"faults": False, "redundant": 2},
    "providers_faults_redundant": {"faults": True, "redundant": 2},
}
FAULTS = {"slow_step_share": 0.05, "slow_factor": 20.0, "stuck_episode_share": 0.01}
NUM_PROVIDERS = 2
DEFAULT_GROUPS_PER_STEP = 80  # five times the default engines' slots: see _config
# The RLVR workload's shape (what `rollmesh bench ceiling` plays when given no run config).


def agentic_groups(groups_per_step: int) -> int:
    """The agentic variant's step: see ``_config``."""
    return max(1, round(groups_per_step / 3))


def _config(
    tmp: Path,
    name: str,
    scenario: dict,
    agentic: bool,
    *,
    engines: int,
    time_scale: float,
    steps: int,
    tokenizer: str,
    suspend_mode: str = "in_place",
    groups_per_step: int = DEFAULT_GROUPS_PER_STEP,
    providers: list[str] | None = None,
    redundant: int = 0,
    prompt_share: float = 0.0,
    tail_prompts: int = 0,
) -> Path:
    """``providers``: the environments' provider URLs (REST): the episodes run there, not in the EnvManager."""
    dataset = _dataset(tmp)
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
        "engine": {
            "type": "sim",
            "max_running_requests": max_running,
            "time_scale": time_scale,
            "lengths": {"prompt_share": prompt_share},
        },
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
            "env": {"type": "sim", **env_args}
            if not providers
            else {"type": "remote", "protocol": "http", "addresses": providers, "num_seeds": 1000},
            "redundant_members": redundant,
            "group_size": group_size,
            # Enough workers for the largest bound: (4 + 1) x groups_per_step groups in flight.
            "num_workers": 5 * groups_per_step,
            "scheduling": scenario["scheduling"],
            "tail_batching": {"redundant_prompts": tail_prompts},
            "replicate_prompts": scenario["replicate"],
            "episode": {
                "max_turns": env_args["turns"],
                "sampling": {"max_new_tokens": max_new_tokens},
                "generation_timeout_s": 600,
                # The longest simulated step (latency_cap_s), in wall seconds: a step that never answers is cut
                # there (without redundancy, its group waits that long).
                "step_timeout_s": 600 / time_scale if providers else 600,
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
    from launch.config import load_config
    from launch.mesh import start_mesh, start_trainer
    from rollout.engines.sim.ceiling import ideal_step_s
    from services.processes import stop_process

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
            occupancy.append((time.time(), running_sequences(mesh.engine_urls)))
            time.sleep(0.25)
        if trainer.returncode != 0:
            raise RuntimeError(f"trainer failed ({trainer.returncode}): see {run_dir / 'logs' / 'trainer.log'}")
        stats = buffer_stats(mesh.buffer)
        stale_share = stale_token_share(mesh.metrics.get("env-manager", []))
        members = member_fates(mesh.metrics.get("env-manager", []))
        kept_lengths = kept_length_buckets(mesh.metrics.get("env-manager", []))
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
    ideal = ideal_step_s(
        gen_tokens, train_s, cfg.engine, engines=cfg.run.num_engines, max_running=cfg.engine.max_running_requests
    )
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
        "trained_tokens_per_step": sum(r["tokens"] for r in measured) / len(measured),
        "kept_member_length_share": kept_lengths,
        **members,
    }


def _rules_reference(cfg, warmup: int, steps: int) -> dict:
    from rollout.engines.sim.ceiling import ceiling

    def play(**kw) -> dict:
        return ceiling(
            cfg.engine,
            cfg.trainer,
            engines=cfg.run.num_engines,
            max_running=cfg.engine.max_running_requests,
            groups_per_step=cfg.controller.groups_per_step,
            group_size=cfg.env_manager.group_size,
            async_ratio=cfg.controller.async_ratio,
            max_new_tokens=cfg.env_manager.episode.sampling.max_new_tokens,
            **kw,
        )

    # A few measured steps early in a run are not steady state (the first long tails are still
    # running): compare like with like, and give the steady state too.
    window = [play(steps=steps, warmup=warmup, seed=s)["step_s"] for s in range(20)]
    return {"window_step_s": sum(window) / len(window), "steady": play(steps=200, warmup=20)}


def run(
    tokenizer: str,
    steps: int = 6,
    warmup: int = 2,
    engines: int = SHAPE["engines"],
    time_scale: float = 25.0,
    scenarios: list[str] | None = None,
    agentic: bool = True,
    progress=print,
    keep: Path | None = None,
    suspend_mode: str = "in_place",
    groups_per_step: int = DEFAULT_GROUPS_PER_STEP,
    providers: bool = False,
    tail: bool = False,
) -> dict:
    """Run the scenarios; returns the table rows and the summary the JSON line reports. ``providers``:
    only the agentic scenarios with provider processes, faults and redundancy (``PROVIDER_SCENARIOS``)."""
    if steps < 1 or warmup < 1 or groups_per_step < 1:
        raise BadOption("steps, warmup and groups_per_step: must be >= 1")
    if tail:
        return run_tail(
            tokenizer,
            steps,
            warmup,
            engines,
            time_scale,
            progress,
            keep,
            suspend_mode,
            groups_per_step,
            _chosen(scenarios, TAIL_SCENARIOS),
        )
    if providers:
        return run_providers(
            tokenizer,
            steps,
            warmup,
            engines,
            time_scale,
            progress,
            keep,
            suspend_mode,
            groups_per_step,
            _chosen(scenarios, PROVIDER_SCENARIOS),
        )
    names = _chosen(scenarios, SCENARIOS)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rollmesh-bench-async-") as d:
        tmp = Path(keep or d)  # kept: configs, logs and metrics.jsonl of every scenario
        tmp.mkdir(parents=True, exist_ok=True)
        plan = [(n, False) for n in names] + ([(n, True) for n in AGENTIC if n in names] if agentic else [])
        for name, is_agentic in plan:
            key = f"agentic_{name}" if is_agentic else name
            path = _config(
                tmp,
                key,
                SCENARIOS[name],
                is_agentic,
                engines=engines,
                time_scale=time_scale,
                steps=warmup + steps,
                tokenizer=tokenizer,
                suspend_mode=suspend_mode,
                groups_per_step=groups_per_step,
            )
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
    return {
        "scenarios": results,
        "suspend_mode": suspend_mode,
        "groups_per_step": groups_per_step,
        "agentic_groups_per_step": agentic_groups(groups_per_step),
        **summarize(results),
    }


# Tail batching (RollPacker) against plain synchronous rollout, on lengths where a prompt's answers are
# alike (half the log-length's variance is the prompt's: hard prompts answer long), which is what tail
# batching relies on. A quarter of the step's groups more per short round: a long round every 4 short
# rounds at most. RollPacker over-provisions responses too: sync_tail_members launches half a group more
# per prompt and keeps the first group_size to end (rollout.redundant_members), so a prompt is in once
# most of its answers are; the cost is a bias toward shorter answers, reported by length bucket.
TAIL_SCENARIOS = {
    "sync_batch": SCENARIOS["sync_batch"],
    "sync_tail": {"async_ratio": 0, "scheduling": "tail", "replicate": True},
    "sync_tail_members": {
        "async_ratio": 0,
        "scheduling": "tail",
        "replicate": True,
        "redundant_members": SHAPE["group_size"] // 2,
    },
}
TAIL_PROMPT_SHARE, TAIL_PROMPTS_SHARE = 0.5, 0.25


def _chosen(scenarios: list[str] | None, known: dict) -> list[str]:
    """``--scenario`` names (default: all of ``known``), each one of ``known``."""
    names = scenarios or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BadOption(f"--scenario: unknown {unknown}; choose from {list(known)}")
    return names


def _ratio(results: dict, a: str, b: str, what: str = "step_s") -> float | None:
    """results[a][what] / results[b][what], None unless both scenarios ran."""
    return round(results[a][what] / results[b][what], 3) if a in results and b in results else None


def run_tail(
    tokenizer: str,
    steps: int,
    warmup: int,
    engines: int,
    time_scale: float,
    progress,
    keep,
    suspend_mode: str,
    groups_per_step: int,
    names: list[str],
) -> dict:
    results: dict[str, dict] = {}
    tail_prompts = max(1, round(TAIL_PROMPTS_SHARE * groups_per_step))
    with tempfile.TemporaryDirectory(prefix="rollmesh-bench-tail-") as d:
        tmp = Path(keep or d)
        tmp.mkdir(parents=True, exist_ok=True)
        for name in names:
            scenario = TAIL_SCENARIOS[name]
            path = _config(
                tmp,
                name,
                scenario,
                False,
                engines=engines,
                time_scale=time_scale,
                steps=warmup + steps,
                tokenizer=tokenizer,
                suspend_mode=suspend_mode,
                groups_per_step=groups_per_step,
                prompt_share=TAIL_PROMPT_SHARE,
                tail_prompts=tail_prompts,
                redundant=scenario.get("redundant_members", 0),
            )
            t0 = time.monotonic()
            results[name] = r = run_scenario(path, warmup)
            progress(
                f"{name:12s} {r['step_s']:8.1f} s/step  trained {r['trained_tokens_per_step']:,.0f} tokens/step  "
                f"kept lengths {r['kept_member_length_share']}  [{time.monotonic() - t0:.0f} s wall]"
            )
    out = {
        "scenarios": results,
        "prompt_share": TAIL_PROMPT_SHARE,
        "redundant_prompts": tail_prompts,
        "groups_per_step": groups_per_step,
    }
    for name, suffix in (("sync_tail", ""), ("sync_tail_members", "_members")):
        speedup = _ratio(results, "sync_batch", name)  # the target: >= 2.5x (RollPacker: 2.03-2.56x against veRL)
        tokens = _ratio(results, name, "sync_batch", "trained_tokens_per_step")
        per_s = None if tokens is None else round(tokens * speedup, 3)
        out |= {
            f"tail{suffix}_speedup_vs_sync": speedup,
            f"trained_tokens_per_step_ratio{suffix}": tokens,
            f"trained_tokens_per_s_ratio{suffix}": per_s,
        }
    return out


def run_providers(
    tokenizer: str,
    steps: int,
    warmup: int,
    engines: int,
    time_scale: float,
    progress,
    keep,
    suspend_mode: str,
    groups_per_step: int,
    names: list[str],
) -> dict:
    from services.processes import start_provider_process, stop_process

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rollmesh-bench-providers-") as d:
        tmp = Path(keep or d)
        tmp.mkdir(parents=True, exist_ok=True)
        dataset = _dataset(tmp)
        for name in names:
            spec = PROVIDER_SCENARIOS[name]
            env = {
                "turns": 4,
                "latency_median_s": 5.0,
                "latency_sigma": 1.2,
                "time_scale": time_scale,
                **(FAULTS if spec["faults"] else {}),
            }
            overrides = [f"dataset_path={dataset}", "max_sessions=8192", *(f"env.{k}={v}" for k, v in env.items())]
            procs = [
                start_provider_process("sim", overrides, log_path=tmp / f"{name}-provider{i}.log")
                for i in range(NUM_PROVIDERS)
            ]
            try:
                path = _config(
                    tmp,
                    name,
                    SCENARIOS["async_2"],
                    True,
                    engines=engines,
                    time_scale=time_scale,
                    steps=warmup + steps,
                    tokenizer=tokenizer,
                    suspend_mode=suspend_mode,
                    groups_per_step=groups_per_step,
                    providers=[url for _, _, url in procs],
                    redundant=spec["redundant"],
                )
                t0 = time.monotonic()
                results[name] = r = run_scenario(path, warmup)
            finally:
                for proc, _, _ in procs:
                    stop_process(proc)
            progress(
                f"{name:28s} {r['step_s']:8.1f} s/step (ideal {r['ideal_step_s']:.1f}, efficiency "
                f"{r['ideal_step_s'] / r['step_s']:.2f})  members cancelled {r['members_cancelled']:.0f}, "
                f"timed out {r['members_timed_out']:.0f}  tokens lost to cancelled "
                f"{r['redundant_token_share'] or 0:.1%}  kept member {r['kept_member_mean_tokens']} tokens  "
                f"[{time.monotonic() - t0:.0f} s wall]"
            )

    def cost(faulty: str, clean: str) -> float | None:
        ratio = _ratio(results, faulty, clean)
        return None if ratio is None else round(ratio - 1, 3)

    both = results.get("providers_faults_redundant")
    return {
        "scenarios": results,
        "faults": FAULTS,
        "providers": NUM_PROVIDERS,
        "agentic_groups_per_step": agentic_groups(groups_per_step),
        "redundant_members": 2,
        # The target: with redundancy, the faults cost <= 10% of step time against the same run without faults.
        "fault_cost_without_redundancy": cost("providers_faults", "providers"),
        "fault_cost_with_redundancy": cost("providers_faults_redundant", "providers_redundant"),
        "efficiency_faults_redundant": round(both["ideal_step_s"] / both["step_s"], 3) if both else None,
        # Bias toward episodes that end sooner: a kept member's mean length with redundancy against without.
        "kept_length_ratio_redundant_vs_not": _ratio(
            results, "providers_redundant", "providers", "kept_member_mean_tokens"
        ),
    }


def _dataset(tmp: Path) -> Path:
    dataset = tmp / "prompts.jsonl"
    if not dataset.exists():
        dataset.write_text("".join(json.dumps({"prompt": f"task {i}", "answer": ""}) + "\n" for i in range(1000)))
    return dataset


def summarize(results: dict[str, dict]) -> dict:
    def ratio(a: str, b: str) -> float | None:
        return _ratio(results, a, b)

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
