"""`rollmesh bench distill`: on-policy distillation against GRPO alone, side by side over seeds.

The digit task as ``examples/distill/digits.yaml`` has it: the student models/tiny-digits untrained
(a digit at chance), the teacher the quickstart's own policy after its run. Every variant is that
config with a few overrides (``VARIANTS``), run as a user runs it (``rollmesh run``) for the same
steps with the same seeds, held out every ``eval_every`` steps. Per run: the first step whose
held-out accuracy reaches the target and the training time to it; per variant: their medians over
the seeds (a run that never reaches it counts as past the last step), and the ratio of each
variant's median steps to GRPO's (below 1: fewer steps than GRPO alone).
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from launch.bench import BadOption
from launch.bench.run_analysis import heldout_curve, training_origin

ROOT = Path(__file__).resolve().parents[2]
STOPPED_RC = 130  # rollmesh run's exit status after a SIGTERM
CONFIG = "examples/distill/digits.yaml"
# Each variant as overrides of the example (GRPO + the forward KL to the teacher's top 8). grpo: no
# teacher; grpo+opd: the sampled-token gap (λ = 0.1) instead of the forward KL; top8: the forward KL
# alone (no reward); grpo+top8: the example as it is; top8/g1: top8 with one sample of each of 128
# prompts a step rather than 8 of 16 (the same answers a step: distillation needs no group to compare
# within, and a one-token answer's 8 samples all see the same context).
_TOP8 = ["trainer.distill.reward_coef=0"]
VARIANTS = {
    "grpo": ["teachers=[]", "env_manager.teacher=null", "env_manager.teacher_top_k=0"],
    "grpo+opd": ["env_manager.teacher_top_k=0", "trainer.distill.coef=0.1"],
    "top8": _TOP8,
    "grpo+top8": [],
    "top8/g1": [*_TOP8, "env_manager.group_size=1", "controller.groups_per_step=128"],
}


def _run_one(
    variant: str, seed: int, steps: int, eval_every: int, teacher: str, out: Path, target: float | None
) -> dict:
    run_dir = out / f"{variant.replace('/', '-')}-seed{seed}"
    sets = [
        f"train_loop.run_dir={run_dir}",
        f"train_loop.steps={steps}",
        "train_loop.checkpoint_every=0",
        f"run.eval_every={eval_every}",
        f"env_manager.seed={seed}",
        f"trainer.seed={seed}",
    ]
    if variant != "grpo":
        sets.append(f"teachers=[{{name: digits, model_path: {teacher}}}]")
    cmd = [sys.executable, "-m", "launch.cli", "run", CONFIG, "--fresh"]
    for s in sets + VARIANTS[variant]:
        cmd += ["--set", s]
    log = out / f"{variant.replace('/', '-')}-seed{seed}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        stopped = _stop_at(proc, run_dir / "heldout.jsonl", target, time.monotonic() + 3600)
    if proc.returncode != 0 and not (stopped and proc.returncode == STOPPED_RC):
        raise RuntimeError(f"{variant} (seed {seed}): rollmesh run failed ({proc.returncode}): see {log}")
    return curve_of(run_dir)


def _stop_at(proc: subprocess.Popen, heldout: Path, target: float | None, deadline: float) -> bool:
    """Wait for ``proc``; with ``target``, stop it (SIGTERM: every service goes with it) once a held-out
    evaluation during training reaches it: the rest of its curve is not what is measured. True if stopped."""
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"rollmesh run still running after an hour: killed (pid {proc.pid})")
        if target is not None and heldout.exists() and _reached_during_training(heldout, target):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            return True
        time.sleep(0.5)
    return False


def _reached_during_training(heldout: Path, target: float) -> bool:
    for line in heldout.read_text().splitlines():
        try:
            h = json.loads(line)
        except json.JSONDecodeError:  # a line still being written
            continue
        if h["step"] is not None and h["accuracy"] >= target:
            return True
    return False


def curve_of(run_dir: Path) -> dict:
    """A finished run's held-out curve, each point with the training time to its step."""
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    heldout = [json.loads(x) for x in (run_dir / "heldout.jsonl").read_text().splitlines() if x.strip()]
    curve = heldout_curve(steps, heldout)
    return {"heldout": curve, "steps": len(steps), "train_wall_s": steps[-1]["wall"] - training_origin(steps)}


def reached(curve: list[dict], target: float) -> dict | None:
    """The first held-out point at or above ``target`` (None: none)."""
    return next((h for h in curve if h["accuracy"] >= target), None)


def summarise(runs: dict[str, list[dict]], target: float, steps: int) -> dict:
    """Per variant the medians over seeds of the steps and training seconds to ``target`` (a run that
    never reaches it: steps + 1, and no time), and each variant's ratio of steps to GRPO's."""
    out: dict = {}
    for variant, seeds in runs.items():
        hits = [reached(r["heldout"], target) for r in seeds]
        to_target = [h["step"] if h else steps + 1 for h in hits]
        out[f"{variant}.steps_to_target"] = statistics.median(to_target)
        out[f"{variant}.reached"] = sum(h is not None for h in hits)
        walls = [h["train_wall_s"] for h in hits if h]
        if walls:
            out[f"{variant}.train_s_to_target"] = statistics.median(walls)
        out[f"{variant}.heldout_last"] = statistics.median(r["heldout"][-1]["accuracy"] for r in seeds)
    if "grpo" in runs:
        for variant in runs:
            if variant != "grpo":
                out[f"{variant}.steps_vs_grpo"] = out[f"{variant}.steps_to_target"] / out["grpo.steps_to_target"]
    return out


def run(
    variants: list[str] | None,
    seeds: int,
    steps: int,
    eval_every: int,
    target: float,
    teacher: str,
    out: str,
    progress=print,
    stop_at_target: bool = True,
) -> dict:
    """``stop_at_target``: a run ends once held out at the target (the steps after it are not measured)."""
    variants = variants or list(VARIANTS)
    if unknown := [v for v in variants if v not in VARIANTS]:
        raise BadOption(f"--variant: {unknown} unknown (one of {sorted(VARIANTS)})")
    if seeds < 1 or steps < 1 or eval_every < 1 or not 0 < target <= 1:
        raise BadOption("--seeds, --steps and --eval-every must be >= 1 and --target in (0, 1]")
    if not (ROOT / teacher / "config.json").exists() and not (Path(teacher) / "config.json").exists():
        raise BadOption(f"--teacher: no model at {teacher} (the quickstart's run writes it: make examples)")
    where = Path(out)
    where.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for seed in range(seeds):  # seed-major: a study cut short still has every variant of the first seeds
        for variant in variants:
            got = _run_one(variant, seed, steps, eval_every, teacher, where, target if stop_at_target else None)
            hit = reached(got["heldout"], target)
            curve = " ".join(f"{h['accuracy']:.2f}" for h in got["heldout"])
            progress(
                f"{variant} seed {seed}: held-out {curve}; "
                + (f"{target} at step {hit['step']} ({hit['train_wall_s']:.0f} s)" if hit else f"{target} not reached")
            )
            runs[variant].append(got)
    result = summarise(runs, target, steps) | {
        "details": {"runs": runs, "steps": steps, "eval_every": eval_every, "target": target, "teacher": teacher}
    }
    (where / "result.json").write_text(json.dumps(result, indent=1))
    return result
