"""``rollmesh bench domains``: does each training batch hold each domain's share when the domains'
episodes take very different times? The real mesh on the latency simulator.

Three domains whose rewards take 0.1 s, 2 s and 20 s (simulated; a verifier, a code sandbox, a
judge), at weights 0.5 / 0.3 / 0.2 and ``async_ratio`` 2: the real services (LLMProxy, SampleBuffer,
AsyncController, EnvManager, trainer loop) as processes on simulated engines and a simulated trainer.
It reports each domain's share of the trained groups per step (mean, and the largest deviation from
its weight) and the seconds per step, against what a user would otherwise run: the same domains with
batches taken oldest first (``buffer.by_domain: false``), and the fast domain alone.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import yaml

from launch.bench import BadOption
from launch.bench.mesh_metrics import scrape_text

# name -> (weight, median reward seconds, simulated)
DOMAINS = {"verifier": (0.5, 0.1), "sandbox": (0.3, 2.0), "judge": (0.2, 20.0)}


def _config(
    tmp: Path,
    name: str,
    domains: dict[str, tuple[float, float]],
    *,
    steps: int,
    groups_per_step: int,
    time_scale: float,
    tokenizer: str,
    tracking: dict | None = None,
    by_domain: bool = True,
) -> Path:
    entries = []
    for domain, (weight, latency_s) in domains.items():
        dataset = tmp / f"{domain}.jsonl"
        dataset.write_text(
            "".join(json.dumps({"prompt": f"{domain} task {i}", "answer": ""}) + "\n" for i in range(200))
        )
        env = {"type": "sim", "latency_median_s": latency_s, "latency_sigma": 0.3, "time_scale": time_scale}
        entries.append({"name": domain, "weight": weight, "dataset_path": str(dataset), "env": env})
    cfg = {
        "model_path": tokenizer,
        "engine": {"type": "sim", "max_running_requests": 64, "time_scale": time_scale},
        "proxy": {"request_timeout_s": 600},
        "buffer": {"backend": "memory", "filter_zero_variance": False, "domain_wait_s": 300, "by_domain": by_domain},
        "controller": {"async_ratio": 2, "groups_per_step": groups_per_step, "update_timeout_s": 120},
        "env_manager": {
            "domains": entries,
            "group_size": 4,
            "num_workers": 3 * groups_per_step,  # (ratio + 1) steps of groups in flight
            "episode": {"sampling": {"max_new_tokens": 256}, "generation_timeout_s": 600, "step_timeout_s": 600},
        },
        "trainer": {"type": "sim", "time_scale": time_scale},
        "train_loop": {
            "steps": steps,
            "run_dir": str(tmp / name),
            "checkpoint_every": 0,
            "get_timeout_s": 600,
            **({"tracking": tracking} if tracking else {}),
        },
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_mesh(config_path: Path) -> dict:
    """Start the mesh, train until the trainer exits; every step line, and each service's /metrics page."""
    import time

    from launch.config import load_config
    from launch.mesh import start_mesh, start_trainer
    from services.processes import stop_process

    cfg = load_config(config_path, [])
    run_dir = Path(cfg.train_loop.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    mesh = start_mesh(cfg, config_path, [], run_dir / "logs")
    trainer = None
    try:
        trainer = start_trainer(config_path, [], mesh, run_dir / "logs" / "trainer.log")
        limit = time.monotonic() + 900
        while trainer.poll() is None and time.monotonic() < limit:
            time.sleep(0.25)
        if trainer.returncode != 0:
            raise RuntimeError(f"trainer failed ({trainer.returncode}): see {run_dir / 'logs' / 'trainer.log'}")
        # the trainer's own page went with it: its numbers are in metrics.jsonl
        pages = {job: "".join(scrape_text(f"http://{t}") for t in targets) for job, targets in mesh.metrics.items()}
    finally:
        if trainer is not None:
            stop_process(trainer)
        mesh.stop()
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"steps": steps, "metrics": pages, "time_scale": cfg.engine.time_scale}


def shares(steps: list[dict], weights: dict[str, float]) -> dict[str, dict]:
    """Per domain: its mean share of a step's groups and the largest deviation from its weight, in
    groups and as a share."""
    total = sum(weights.values())
    out = {}
    for d, w in weights.items():
        counts = [s.get(f"domain/{d}/groups", 0.0) for s in steps]
        per_step = [c / sum(s.get(f"domain/{e}/groups", 0.0) for e in weights) for c, s in zip(counts, steps)]
        want = [w / total * sum(s.get(f"domain/{e}/groups", 0.0) for e in weights) for s in steps]
        out[d] = {
            "weight": round(w / total, 3),
            "share_mean": round(statistics.mean(per_step), 3),
            "max_deviation_groups": round(max(abs(c - x) for c, x in zip(counts, want)), 3),
            "max_deviation_share": round(max(abs(p - w / total) for p in per_step), 3),
        }
    return out


def _step_s(run: dict, warmup: int) -> float:
    steps = run["steps"]
    return (steps[-1]["wall"] - steps[warmup - 1]["wall"]) * run["time_scale"] / (len(steps) - warmup)


def run(
    model_path: str = "models/tiny",
    steps: int = 20,
    warmup: int = 3,
    groups_per_step: int = 10,
    time_scale: float = 50.0,
    compare: bool = True,
    progress=print,
) -> dict:
    if steps <= warmup or warmup < 1:
        raise BadOption(f"--steps ({steps}) must exceed --warmup ({warmup}), which must be >= 1")
    if not (Path(model_path) / "tokenizer_config.json").exists() and not (Path(model_path) / "config.json").exists():
        raise BadOption(f"--model: no tokenizer at {model_path} (make {model_path}/config.json builds it)")
    weights = {d: w for d, (w, _) in DOMAINS.items()}
    with tempfile.TemporaryDirectory(prefix="rollmesh-domains-") as tmp:
        shape = {"steps": steps, "groups_per_step": groups_per_step, "time_scale": time_scale, "tokenizer": model_path}
        progress(f"three domains (rewards 0.1 s, 2 s, 20 s; weights 0.5/0.3/0.2), {steps} steps ...")
        mixed = run_mesh(_config(Path(tmp), "mixed", DOMAINS, **shape))
        result = {
            "steps": steps,
            "groups_per_step": groups_per_step,
            "async_ratio": 2,
            "by_domain": shares(mixed["steps"][warmup:], weights),
            "step_s_mixed": round(_step_s(mixed, warmup), 2),
        }
        for d, row in result["by_domain"].items():
            progress(
                f"{d:>9}: weight {row['weight']:.2f} share {row['share_mean']:.3f}, at most "
                f"{row['max_deviation_groups']:.1f} groups off"
            )
        if compare:
            progress("the same, batches oldest first (buffer.by_domain false) ...")
            fifo = run_mesh(_config(Path(tmp), "fifo", DOMAINS, by_domain=False, **shape))
            result["fifo_by_domain"] = shares(fifo["steps"][warmup:], weights)
            result["step_s_fifo"] = round(_step_s(fifo, warmup), 2)
            for d, row in result["fifo_by_domain"].items():
                progress(f"{d:>9} (oldest first): share {row['share_mean']:.3f}, {row['max_deviation_groups']:.1f} off")
            progress("the fast domain alone ...")
            fast = next(iter(DOMAINS))
            single = run_mesh(_config(Path(tmp), "alone", {fast: (1.0, DOMAINS[fast][1])}, **shape))
            result["step_s_fast_alone"] = round(_step_s(single, warmup), 2)
            result["step_s_ratio_to_fifo"] = round(result["step_s_mixed"] / result["step_s_fifo"], 2)
            result["step_s_ratio_to_fast_alone"] = round(result["step_s_mixed"] / result["step_s_fast_alone"], 2)
        return result
