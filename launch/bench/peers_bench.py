"""``rollmesh bench peers``: rollmesh and TRL's GRPOTrainer side by side in one run, on the same tasks.

What a user would pick instead of rollmesh on one machine is a single-process trainer: TRL's
``GRPOTrainer`` (HF ``generate``, one process). Each task is one of rollmesh's examples; TRL gets what
the example fixes (model, data, reward, group size, prompts a step, learning rate and schedule, answer
length, temperature, one update a batch, no KL) and its own defaults otherwise
(``launch/bench/peers_trl.py``). rollmesh runs the example as ``rollmesh run`` does, with
``run.eval_every`` for its held-out curve.

Both sides report: seconds a step (median and range, the first ``warmup`` steps left out), training
wall time to the held-out target (the held-out scoring's own time is taken out of TRL's clock;
rollmesh scores while it trains, so its clock includes that), held-out before and after, generated
tokens a second, and CPU seconds a step per process (rollmesh: every service of the mesh, sampled
from /proc between the warm-up's end and the last step). The step profile beside it
(``step_profile``): where a rollmesh step's time goes, from its metrics, and the physical floor, the
FLOPs a step needs over the machine's measured matmul rate.

TRL lives in its own environment, ``.venv-peers`` (made on first use: TRL pinned, with rollmesh's own
torch, transformers and math-verify versions, so both sides run the same model code).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from launch.bench import BadOption
from launch.bench.run_analysis import heldout_curve, training_origin

TRL_VERSION = "1.16.0"
PEERS_VENV = Path(".venv-peers")
ROOT = Path(__file__).resolve().parents[2]


class PeersUnavailable(RuntimeError):
    """TRL's environment cannot be built or run here; the message says why in one line."""


@dataclass(frozen=True)
class Task:
    """One task both sides train: an example config, how long, and what held-out score counts."""

    config: str
    steps: int
    eval_every: int  # 0: held-out before and after only
    target: float | None  # the held-out accuracy to reach; None: compare the held-out after ``steps``
    warmup: int  # first steps left out of the step time (engine start, first compile)


TASKS = {
    "quickstart": Task("examples/quickstart.yaml", steps=300, eval_every=25, target=0.8, warmup=5),
    "math": Task("examples/smollm2-math.yaml", steps=10, eval_every=0, target=None, warmup=2),
}


# ----------------------------------------------------------------------------- TRL's environment
def peer_pins() -> list[str]:
    """TRL pinned; torch, transformers and math-verify as rollmesh's own environment has them."""
    pins = [f"trl=={TRL_VERSION}"]
    for name in ("torch", "transformers", "math-verify"):
        pins.append(f"{name}=={importlib.metadata.version(name)}")
    return pins


def ensure_peers(venv: Path = PEERS_VENV, progress=print) -> Path:
    """The peers' Python, the environment built first if it is missing or its pins changed. Raises
    ``PeersUnavailable`` with pip's last line when it cannot be built."""
    python, stamp = venv / "bin" / "python", venv / ".installed"
    pins = peer_pins()
    if python.exists() and stamp.exists() and stamp.read_text().split() == pins:
        return python
    progress(f"building {venv} ({' '.join(pins)}): once, a few minutes")
    install = [str(python), "-m", "pip", "install", "-q", "--no-compile", *pins]
    steps = [[sys.executable, "-m", "venv", str(venv)], install]
    for cmd in steps:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PeersUnavailable(f"TRL's environment {venv} could not be built: {e}") from None
        if done.returncode != 0:
            lines = [x for x in (done.stderr or done.stdout).splitlines() if x.strip() and "WARNING" not in x]
            raise PeersUnavailable(
                f"TRL's environment {venv} could not be built ({cmd[2] if cmd[1] == '-m' else cmd[0]} exited "
                f"{done.returncode}): {lines[-1] if lines else 'no output'}"
            )
    stamp.write_text(" ".join(pins))
    return python


# ----------------------------------------------------------------------------- the two sides
def _task_spec(task: Task, out_dir: Path, seed: int) -> dict:
    """What TRL is given: the example's own values, read from its resolved config."""
    from launch.config import load_config

    cfg = load_config(Path(task.config), [])
    em = cfg.env_manager
    if not isinstance(em.reward, str):
        raise BadOption(f"{task.config}: its reward is a configured verifier; the TRL side takes a function name")
    return {
        "model_path": cfg.trainer.model_path or cfg.model_path,
        "train_path": em.dataset_path,
        "heldout_path": cfg.run.heldout_path,
        "reward": em.reward,
        "group_size": em.group_size,
        "prompts_per_step": cfg.controller.groups_per_step,
        "lr": cfg.trainer.lr,
        "max_new_tokens": em.episode.sampling.max_new_tokens,
        "temperature": em.episode.sampling.temperature,
        "steps": task.steps,
        "eval_every": task.eval_every,
        "seed": seed,
        "threads": 0,  # torch's default: every core (TRL's documented behaviour on CPU)
        "out_dir": str(out_dir / "trl"),
    }


def run_trl(python: Path, task: Task, out_dir: Path, seed: int) -> dict:
    spec = out_dir / "trl_task.json"
    spec.write_text(json.dumps(_task_spec(task, out_dir, seed)))
    result, log = out_dir / "trl_result.json", out_dir / "trl.log"
    env = os.environ | {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [str(python), str(ROOT / "launch/bench/peers_trl.py"), "--task", str(spec), "--out", str(result)]
    with log.open("w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=3 * 3600, cwd=ROOT)
    if done.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
        raise PeersUnavailable(f"TRL's run failed ({done.returncode}; {log}): {tail[0]}")
    return json.loads(result.read_text())


def _processes(root_pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of ``root_pid`` and every process under it, by pid: (role, seconds)."""
    import psutil

    out = {}
    try:
        procs = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            argv, t = p.cmdline(), p.cpu_times()
        except psutil.Error:
            continue
        role = argv[argv.index("serve") + 1] if "serve" in argv[:-1] else "launcher"
        out[p.pid] = (role, t.user + t.system)
    return out


def _cpu_between(first: dict, last: dict) -> dict[str, float]:
    """CPU seconds each role spent between two samples (a process that restarted counts from 0)."""
    roles: dict[str, float] = {}
    for pid, (role, t) in last.items():
        roles[role] = roles.get(role, 0.0) + t - first.get(pid, (role, 0.0))[1]
    return roles


def run_rollmesh(task: Task, out_dir: Path, seed: int) -> dict:
    """``rollmesh run`` of the example, as a user runs it, with its CPU per process sampled."""
    run_dir = out_dir / "rollmesh"
    sets = [
        f"train_loop.run_dir={run_dir}",
        f"train_loop.steps={task.steps}",
        f"run.eval_every={task.eval_every}",
        "train_loop.checkpoint_every=0",
        f"env_manager.seed={seed}",
        f"trainer.seed={seed}",
    ]
    cmd = [sys.executable, "-m", "launch.cli", "run", task.config, "--fresh"]
    for s in sets:
        cmd += ["--set", s]
    log = out_dir / "rollmesh.log"
    metrics = run_dir / "metrics.jsonl"
    samples: dict[str, dict] = {}
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, text=True)

        def sample() -> None:  # the CPU of every process at the warm-up's end and at the last step
            while proc.poll() is None:
                n = len(metrics.read_text().splitlines()) if metrics.exists() else 0
                if n >= task.warmup and "first" not in samples:
                    samples["first"], samples["first_step"] = _processes(proc.pid), {"n": n}
                if n >= task.steps and "last" not in samples:
                    samples["last"], samples["last_step"] = _processes(proc.pid), {"n": n}
                    return
                time.sleep(0.05)

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        try:
            rc = proc.wait(timeout=3 * 3600)
        finally:
            if proc.poll() is None:
                proc.terminate()
        watcher.join(5)
    if rc != 0:
        raise RuntimeError(f"rollmesh run failed ({rc}): see {log}")
    steps = [json.loads(x) for x in metrics.read_text().splitlines()]
    heldout = [json.loads(x) for x in (run_dir / "heldout.jsonl").read_text().splitlines()]
    curve, origin = heldout_curve(steps, heldout), training_origin(steps)
    ends = [s["wall"] - origin for s in steps]
    durations = [b - a for a, b in zip([0.0, *ends], ends)][task.warmup :]
    cpu = {}
    if "first" in samples and "last" in samples:
        between = samples["last_step"]["n"] - samples["first_step"]["n"]
        cpu = {k: v / max(between, 1) for k, v in sorted(_cpu_between(samples["first"], samples["last"]).items())}
    return {
        "side": "rollmesh",
        "steps": len(steps),
        "step_s_median": statistics.median(durations),
        "step_s_min": min(durations),
        "step_s_max": max(durations),
        "train_wall_s": ends[-1],
        "heldout": curve,
        "rewards": [s.get("reward_mean", 0.0) for s in steps],
        "generated_tokens_per_s": sum(s.get("tokens", 0.0) for s in steps) / ends[-1],
        "generated_tokens_per_step": statistics.median(s.get("tokens", 0.0) for s in steps),
        "cpu_s_per_step": cpu,
        "profile": step_profile(steps[task.warmup :]),
    }


# ----------------------------------------------------------------------------- where a step goes
PHASES = ("time_get_s", "time_train_s", "time_publish_s", "time_export_s", "time_suspend_s", "time_load_s")


def step_profile(steps: list[dict]) -> dict[str, float]:
    """Mean seconds a step spends in each phase the trainer times (waiting for the batch, training,
    publishing and its parts: means, since a wait may come every other step), the step itself
    (median and mean) and what is left of it (metrics, logging, checkpoints)."""
    out = {k.removeprefix("time_"): statistics.mean(s.get(k, 0.0) for s in steps) for k in PHASES}
    if len(steps) > 1:
        walls = [b["wall"] - a["wall"] for a, b in zip(steps, steps[1:])]
        timed = [sum(s.get(k, 0.0) for k in PHASES[:3]) for s in steps[1:]]
        out["step_s_median"], out["step_s_mean"] = statistics.median(walls), statistics.mean(walls)
        out["other_s"] = statistics.mean(w - t for w, t in zip(walls, timed))
    return out


def matmul_gflops(threads: int, size: int = 512, seconds: float = 1.0) -> float:
    """This machine's float32 matmul rate on ``threads`` threads (GFLOP/s), measured now."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            n += 1
        return 2 * size**3 * n / (time.perf_counter() - t0) / 1e9
    finally:
        torch.set_num_threads(old)


def step_flops(config: str, answer_tokens: float) -> float:
    """The FLOPs a step needs at least: the generation's forward over every prompt and answer token
    (each prompt once a group), and the training's forward and backward (3×) over the trained
    sequences (a group's prompt once: tree training), 2 × parameters a token each. ``answer_tokens``:
    the tokens a step generates."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from launch.config import load_config
    from rollout.chat_turns import render_prompt

    cfg = load_config(Path(config), [])
    model_cfg = AutoConfig.from_pretrained(cfg.model_path, local_files_only=True)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(model_cfg).parameters())
    em = cfg.env_manager
    rows = [json.loads(x) for x in Path(em.dataset_path).read_text().splitlines() if x.strip()]
    tok = AutoTokenizer.from_pretrained(cfg.model_path)
    prompt = statistics.mean(len(render_prompt(tok, r["prompt"])) for r in rows[:64])
    groups, size = cfg.controller.groups_per_step, em.group_size
    answer = answer_tokens / (groups * size)
    per_group = prompt + size * answer
    return 2 * params * groups * per_group * (1 + 3)


def run(
    tasks: list[str],
    seed: int = 0,
    steps: int | None = None,
    out: Path | None = None,
    peers_venv: Path = PEERS_VENV,
    progress=print,
) -> dict:
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise BadOption(f"--task: {unknown or tasks} (choose from {', '.join(TASKS)})")
    if steps is not None and steps < 2:
        raise BadOption(f"--steps: at least 2, got {steps}")
    python = ensure_peers(peers_venv, progress)
    result: dict = {"machine": {"cores": os.cpu_count()}, "trl_version": TRL_VERSION, "seed": seed, "tasks": {}}
    result["machine"]["matmul_gflops_1_thread"] = round(matmul_gflops(1), 1)
    result["machine"]["matmul_gflops_all"] = round(matmul_gflops(os.cpu_count() or 1), 1)
    for name in tasks:
        task = TASKS[name]
        if steps is not None:
            task = Task(task.config, steps, min(task.eval_every, steps), task.target, min(task.warmup, steps - 1))
        with tempfile.TemporaryDirectory(prefix=f"peers-{name}-") as tmp:
            tmp = Path(tmp)
            progress(f"{name}: TRL {TRL_VERSION}, {task.steps} steps")
            trl = run_trl(python, task, tmp, seed)
            progress(f"{name}: TRL {trl['step_s_median']:.3f} s a step; rollmesh, {task.steps} steps")
            mesh = run_rollmesh(task, tmp, seed)
            progress(f"{name}: rollmesh {mesh['step_s_median']:.3f} s a step")
        flops = step_flops(task.config, mesh["generated_tokens_per_step"])
        floor_s = flops / (result["machine"]["matmul_gflops_all"] * 1e9)
        result["tasks"][name] = compare(task, trl, mesh) | {"task": asdict(task), "floor_s_per_step": floor_s}
    if out is not None:
        out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _reached(curve: list[dict], target: float) -> dict | None:
    return next((h for h in curve if h["accuracy"] >= target), None)


def compare(task: Task, trl: dict, mesh: dict) -> dict:
    """The two sides' numbers and their ratios (above 1: rollmesh faster)."""
    out = {"trl": trl, "rollmesh": mesh}
    out["step_speedup"] = trl["step_s_median"] / mesh["step_s_median"]
    out["wall_speedup_same_steps"] = trl["train_wall_s"] / mesh["train_wall_s"]
    if task.target is not None:
        a, b = _reached(trl["heldout"], task.target), _reached(mesh["heldout"], task.target)
        out["trl_reached"] = a
        out["rollmesh_reached"] = b
        if a and b:
            out["time_to_target_speedup"] = a["train_wall_s"] / max(b["train_wall_s"], 1e-9)
    out["heldout_before"] = {"trl": trl["heldout"][0]["accuracy"], "rollmesh": mesh["heldout"][0]["accuracy"]}
    out["heldout_after"] = {"trl": trl["heldout"][-1]["accuracy"], "rollmesh": mesh["heldout"][-1]["accuracy"]}
    return out
