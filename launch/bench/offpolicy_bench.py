"""`rollmesh bench offpolicy`: does each loss hold up when samples get stale? (ROLL Flash, Figure 4.)

An example (the quickstart: find the digit, GRPO, groups of 8; or the SmolLM2 math example)
trained to the same step count with each policy loss at each async ratio and learning rate, with
the same seeds: per combination, the reward over the last steps, the reward of the samples the
policy generated after the same number of updates (``run_analysis``: a step's batch at ratio 2 was
sampled two versions earlier), the held-out accuracy at the end, the wall time, how far the policy
moved per step (with ``--audit``: ``trainer.audit_versions`` 2, which also checks μ against each
token's version), which prompts were trained, and a plot of reward against step per async ratio.
``ppo_naive`` is PPO whose ratio is taken against π_prox (the trainer's weights at the start of
the step): PPO that never sees the behaviour policy μ, the baseline the corrections are meant to
beat once samples are versions old.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from launch.bench import BadOption
from launch.bench.run_analysis import data_bias, movement, reward_at_versions, reward_by_version

# Each loss as trainer overrides. Every variant but ppo_naive takes μ into account;
# decoupled_ppo/trust bounds each step's policy movement (trainer.max_step_kl).
LOSSES = {
    "ppo": {"loss.type": "ppo"},
    "ppo_naive": {"loss.type": "ppo", "loss.old_policy": "proximal"},
    "decoupled_ppo": {"loss.type": "decoupled_ppo"},
    "decoupled_ppo/trust": {"loss.type": "decoupled_ppo", "max_step_kl": "0.05"},
    "tis": {"loss.type": "tis"},
    "cispo": {"loss.type": "cispo"},
    "topr": {"loss.type": "topr"},
    # MoE models: decoupled PPO with free routing against replay of the engine's experts (docs/moe.md)
    "decoupled_ppo/free": {"loss.type": "decoupled_ppo", "moe.routing": "free"},
    "decoupled_ppo/replay": {"loss.type": "decoupled_ppo", "moe.routing": "replay"},
}
MOE_ONLY = ("decoupled_ppo/free", "decoupled_ppo/replay")
FINAL = re.compile(r"^final: steps=(\d+) reward_mean_last5=([\d.]+) heldout_accuracy=([\d.na]+) wall_s=([\d.]+)$", re.M)
# The supervisor's line for a service that died (launch/supervisor.py): a run that restarted its trainer
# without a checkpoint went on from earlier weights, so its curve is not like the others'.
RESTART = re.compile(r"^(\S+) exited with code (-?\d+): restart \d+", re.M)


def restarts_in(output: str) -> dict[str, int]:
    """How often each service was restarted during a run, from ``rollmesh run``'s output."""
    counts: dict[str, int] = {}
    for name, _code in RESTART.findall(output):
        counts[name] = counts.get(name, 0) + 1
    return counts


# What each example is run with: its config, its model and its length (steps) by default.
EXAMPLES = {
    "quickstart": ("examples/quickstart.yaml", "models/tiny-digits", 100),
    "smollm2-math": ("examples/smollm2-math.yaml", "models/smollm2", 40),
    "moe-quickstart": ("examples/moe-quickstart.yaml", "models/tiny-moe-digits", 100),
}


@dataclass(frozen=True)
class Variant:
    """One combination: every seed of it runs with these."""

    loss: str
    ratio: int
    lr: float | None  # None: the example's own

    @property
    def label(self) -> str:
        return f"{self.loss}@{self.ratio}" + ("" if self.lr is None else f" lr={self.lr:g}")


def _command(example: str, model: str, run_dir: Path, v: Variant, steps: int, seed: int, audit: bool) -> list[str]:
    sets = [
        f"model_path={model}",
        f"train_loop.run_dir={run_dir}",
        f"train_loop.steps={steps}",
        f"train_loop.checkpoint_every={steps}",
        f"controller.async_ratio={v.ratio}",
        f"trainer.seed={seed}",
        f"env_manager.seed={seed}",
    ] + [f"trainer.{k}={x}" for k, x in LOSSES[v.loss].items()]
    sets += [f"trainer.lr={v.lr}"] if v.lr is not None else []
    # The audit forwards unpacked (trainer.audit_versions): the examples' tree training goes off with it.
    sets += ["trainer.audit_versions=2", "trainer.pack_sequences=false", "trainer.tree_packing=false"] if audit else []
    cmd = [sys.executable, "-m", "launch.cli", "run", EXAMPLES[example][0], "--fresh"]
    return cmd + [a for s in sets for a in ("--set", s)]


def _one(command: list[str], run_dir: Path, what: str, steps: int, timeout_s: float = 3600) -> dict:
    t0 = time.monotonic()
    # Its own session: on a timeout the whole mesh goes (SIGTERM, which the launcher passes on), not the
    # launcher alone with its services left running.
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
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
        raise RuntimeError(f"{what}: not done within {timeout_s:.0f} s\n{out[-2000:]}") from None
    m = FINAL.search(out)
    if proc.returncode != 0 or m is None:
        raise RuntimeError(f"{what}: exit {proc.returncode}\n{out[-2000:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.endswith("}")]
    tail = lines[-max(1, steps // 10) :]  # the last tenth of the run
    return {
        "reward_last": statistics.mean(x["reward_mean"] for x in tail),
        # the same number of updates at every ratio: versions 80-89 % of the run (ratio 8 trains them all)
        "reward_at_version": reward_at_versions(lines, int(0.8 * steps), int(0.9 * steps) - 1),
        "heldout_accuracy": float(m.group(3)),
        "wall_s": time.monotonic() - t0,
        "staleness_mean": statistics.mean(x["staleness_mean"] for x in lines),
        "curve": [x["reward_mean"] for x in lines],
        "kl_curve": [x.get("policy_kl_1") for x in lines],  # None before the audit has an older version
        "curve_by_version": reward_by_version(lines),
        "bias": data_bias(lines),
        "movement": movement(lines),
        "restarts": restarts_in(out),
    }


def _plot(results: list[dict], ratios: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ratios), figsize=(4.5 * len(ratios), 3.5), sharey=True, squeeze=False)
    for ax, ratio in zip(axes[0], ratios, strict=True):
        for row in results:
            if row["ratio"] != ratio:
                continue
            curve = [statistics.mean(c) for c in zip(*(r["curve"] for r in row["runs"]), strict=False)]
            legend = row["loss"] + ("" if row["lr"] is None else f" lr={row['lr']:g}")
            ax.plot(range(1, len(curve) + 1), curve, label=legend, linewidth=1)
        ax.set_title(f"async_ratio {ratio}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("reward mean")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def _spread(values: list[float | None]) -> dict:
    """Mean, lowest and highest over the seeds (None where no seed had the value)."""
    xs = [x for x in values if x is not None]
    if not xs:
        return {"mean": None, "min": None, "max": None}
    return {"mean": statistics.mean(xs), "min": min(xs), "max": max(xs)}


def _summary(v: Variant, runs: list[dict]) -> dict:
    keys = sorted({k for r in runs for k in r["movement"]})
    return {
        "label": v.label,
        "loss": v.loss,
        "ratio": v.ratio,
        "lr": v.lr,
        "reward_last": _spread([r["reward_last"] for r in runs]),
        "reward_at_version": _spread([r["reward_at_version"] for r in runs]),
        "heldout_accuracy": _spread([r["heldout_accuracy"] for r in runs]),
        "wall_s": statistics.mean(r["wall_s"] for r in runs),
        "staleness_mean": statistics.mean(r["staleness_mean"] for r in runs),
        "movement": {k: statistics.mean(r["movement"][k] for r in runs if k in r["movement"]) for k in keys},
        "bias": {k: statistics.mean(r["bias"][k] for r in runs) for k in runs[0]["bias"]},
        "restarts": sum(sum(r.get("restarts", {}).values()) for r in runs),
        "runs": runs,
    }


def run(
    model_path: str | None = None,
    losses: list[str] | None = None,
    ratios: list[int] | None = None,
    steps: int | None = None,
    seeds: int = 1,
    out_dir: str = "runs/bench-offpolicy",
    progress=print,
    lrs: list[float] | None = None,
    example: str = "quickstart",
    audit: bool = False,
    first_seed: int = 0,
) -> dict:
    from services.auth import AuthConfig, ensure_token

    if example not in EXAMPLES:
        raise BadOption(f"--example: unknown {example!r}; choose from {list(EXAMPLES)}")
    model_path = model_path or EXAMPLES[example][1]
    steps = steps or EXAMPLES[example][2]
    losses = losses or [x for x in LOSSES if (x in MOE_ONLY) == (example == "moe-quickstart")]
    ratios = [0, 2, 8] if ratios is None else ratios
    if unknown := [x for x in losses if x not in LOSSES]:
        raise BadOption(f"--loss: unknown {unknown}; choose from {list(LOSSES)}")
    if any(r < 0 for r in ratios):
        raise BadOption(f"--ratio: must be >= 0, got {ratios}")
    if lrs and any(x <= 0 for x in lrs):
        raise BadOption(f"--lr: must be > 0, got {lrs}")
    if steps < 10 or seeds < 1:
        raise BadOption(f"--steps must be >= 10 and --seeds >= 1, got {steps} and {seeds}")
    if not (Path(model_path) / "config.json").exists():
        raise BadOption(f"--model: no model at {model_path} (make {model_path}/config.json builds it)")
    ensure_token(AuthConfig())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    variants = [Variant(loss, ratio, lr) for loss in losses for lr in (lrs or [None]) for ratio in ratios]
    runs: dict[Variant, list[dict]] = {v: [] for v in variants}
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rollmesh-offpolicy-") as tmp:
        # Seeds outer: a study stopped part-way still compares every variant on the same seeds.
        for seed in range(first_seed, first_seed + seeds):
            for v in variants:
                run_dir = Path(tmp) / f"{v.loss.replace('/', '-')}-{v.ratio}-{v.lr}-{seed}"
                cmd = _command(example, model_path, run_dir, v, steps, seed, audit)
                r = _one(cmd, run_dir, v.label, steps)
                kept = out / "runs" / f"{run_dir.name}.jsonl"  # every step's metrics, for a closer look
                kept.parent.mkdir(exist_ok=True)
                shutil.copyfile(run_dir / "metrics.jsonl", kept)
                if r["restarts"]:  # the services' logs say why something died
                    shutil.copytree(run_dir / "logs", out / "runs" / f"{run_dir.name}-logs", dirs_exist_ok=True)
                kl = r["movement"].get("policy_kl_1")
                progress(
                    f"{v.label:>24}: seed {seed} reward {r['reward_last']:.3f} held-out {r['heldout_accuracy']:.3f}"
                    + ("" if kl is None else f" KL/step {kl:.4f}")
                    + f" in {r['wall_s']:.0f} s"
                    + (f" (restarted: {r['restarts']}; logs kept)" if r["restarts"] else "")
                )
                runs[v].append(r)
                results = [_summary(x, rs) for x, rs in runs.items() if rs]
                # written as it goes: a later failure keeps what was measured
                (out / "offpolicy.json").write_text(json.dumps(results))
    plot = out / "offpolicy.png"
    _plot(results, ratios, plot)
    return {
        "example": example,
        "steps": steps,
        "seeds": list(range(first_seed, first_seed + seeds)),
        "plot": str(plot),
        **{f"heldout {r['label']}": round(r["heldout_accuracy"]["mean"], 3) for r in results},
        "by_variant": [{k: x for k, x in r.items() if k != "runs"} for r in results],
    }
