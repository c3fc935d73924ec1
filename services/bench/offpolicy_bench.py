"""`rollmesh bench offpolicy`: does each loss hold up when samples get stale? (ROLL Flash, Figure 4.)

The quickstart (find the digit; GRPO advantages, groups of 8) trained to the same step count with
each policy loss at each async ratio, with the same seeds: per combination, the reward over the
last steps, the held-out accuracy at the end and the wall time, and a plot of reward against step,
one panel per async ratio. ``ppo_naive`` is PPO whose ratio is taken against π_prox (the trainer's
weights at the start of the step): PPO that never sees the behaviour policy μ, the baseline the
corrections are meant to beat once samples are versions old.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.bench import BadOption

# Each loss as a trainer.loss override. Every variant but ppo_naive takes μ into account.
LOSSES = {
    "ppo": {"type": "ppo"},
    "ppo_naive": {"type": "ppo", "old_policy": "proximal"},
    "decoupled_ppo": {"type": "decoupled_ppo"},
    "tis": {"type": "tis"},
    "cispo": {"type": "cispo"},
    "topr": {"type": "topr"},
}
FINAL = re.compile(r"^final: steps=(\d+) reward_mean_last5=([\d.]+) heldout_accuracy=([\d.na]+) wall_s=([\d.]+)$", re.M)


def _command(model: str, run_dir: Path, loss: str, ratio: int, steps: int, seed: int) -> list[str]:
    sets = [
        f"model_path={model}",
        f"train_loop.run_dir={run_dir}",
        f"train_loop.steps={steps}",
        f"train_loop.checkpoint_every={steps}",
        f"controller.async_ratio={ratio}",
        f"trainer.seed={seed}",
        f"env_manager.seed={seed}",
    ] + [f"trainer.loss.{k}={v}" for k, v in LOSSES[loss].items()]
    cmd = [sys.executable, "-m", "services.cli", "run", "examples/quickstart.yaml", "--fresh"]
    return cmd + [a for s in sets for a in ("--set", s)]


def _one(model: str, run_dir: Path, loss: str, ratio: int, steps: int, seed: int, timeout_s: float = 3600) -> dict:
    t0 = time.monotonic()
    # Its own session: on a timeout the whole mesh goes (SIGTERM, which the launcher passes on), not the
    # launcher alone with its services left running.
    proc = subprocess.Popen(
        _command(model, run_dir, loss, ratio, steps, seed),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        raise RuntimeError(f"{loss} at async_ratio {ratio}: not done within {timeout_s:.0f} s\n{out[-2000:]}") from None
    m = FINAL.search(out)
    if proc.returncode != 0 or m is None:
        raise RuntimeError(f"{loss} at async_ratio {ratio}: exit {proc.returncode}\n{out[-2000:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.endswith("}")]
    tail = lines[-max(1, steps // 10) :]  # the last tenth of the run
    return {
        "reward_last": statistics.mean(x["reward_mean"] for x in tail),
        "heldout_accuracy": float(m.group(3)),
        "wall_s": time.monotonic() - t0,
        "staleness_mean": statistics.mean(x["staleness_mean"] for x in lines),
        "curve": [x["reward_mean"] for x in lines],
    }


def _plot(results: dict, ratios: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ratios), figsize=(4.5 * len(ratios), 3.5), sharey=True, squeeze=False)
    for ax, ratio in zip(axes[0], ratios, strict=True):
        for loss, per_ratio in results.items():
            runs = per_ratio[str(ratio)]["runs"]
            curve = [statistics.mean(c) for c in zip(*(r["curve"] for r in runs), strict=False)]
            ax.plot(range(1, len(curve) + 1), curve, label=loss, linewidth=1)
        ax.set_title(f"async_ratio {ratio}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("reward mean")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def run(
    model_path: str,
    losses: list[str] | None = None,
    ratios: list[int] | None = None,
    steps: int = 100,
    seeds: int = 1,
    out_dir: str = "runs/bench-offpolicy",
    progress=print,
) -> dict:
    from services.auth import AuthConfig, ensure_token

    losses = losses or list(LOSSES)
    ratios = [0, 2, 8] if ratios is None else ratios
    if unknown := [x for x in losses if x not in LOSSES]:
        raise BadOption(f"--loss: unknown {unknown}; choose from {list(LOSSES)}")
    if any(r < 0 for r in ratios):
        raise BadOption(f"--ratio: must be >= 0, got {ratios}")
    if steps < 10 or seeds < 1:
        raise BadOption(f"--steps must be >= 10 and --seeds >= 1, got {steps} and {seeds}")
    if not (Path(model_path) / "config.json").exists():
        raise BadOption(f"--model: no model at {model_path} (make models/tiny-digits/config.json builds it)")
    ensure_token(AuthConfig())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="rollmesh-offpolicy-") as tmp:
        for loss in losses:
            for ratio in ratios:
                runs = []
                for seed in range(seeds):
                    r = _one(model_path, Path(tmp) / f"{loss}-{ratio}-{seed}", loss, ratio, steps, seed)
                    progress(
                        f"{loss:>13} async_ratio {ratio}: seed {seed} reward {r['reward_last']:.3f} "
                        f"held-out {r['heldout_accuracy']:.3f} in {r['wall_s']:.0f} s"
                    )
                    runs.append(r)
                results.setdefault(loss, {})[str(ratio)] = {
                    "reward_last": statistics.mean(r["reward_last"] for r in runs),
                    "heldout_accuracy": statistics.mean(r["heldout_accuracy"] for r in runs),
                    "heldout_accuracy_sd": statistics.stdev(r["heldout_accuracy"] for r in runs) if seeds > 1 else None,
                    "wall_s": statistics.mean(r["wall_s"] for r in runs),
                    "staleness_mean": statistics.mean(r["staleness_mean"] for r in runs),
                    "runs": runs,
                }
                # written as it goes: a later failure keeps what was measured
                (out / "offpolicy.json").write_text(json.dumps(results))
    plot = out / "offpolicy.png"
    _plot(results, ratios, plot)
    summary = {
        f"{loss}@{ratio}": round(v["heldout_accuracy"], 3) for loss, per in results.items() for ratio, v in per.items()
    }
    table = {
        loss: {ratio: {k: v for k, v in r.items() if k != "runs"} for ratio, r in per.items()}
        for loss, per in results.items()
    }
    return {
        "steps": steps,
        "seeds": seeds,
        "plot": str(plot),
        **{f"heldout {k}": v for k, v in summary.items()},
        "by_loss_and_ratio": table,
    }
