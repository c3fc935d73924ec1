"""`rollmesh run`: every service as its own local process on loopback, progress, evaluation.

Order: engines → LLMProxy → SampleBuffer → AsyncController → EnvManager → trainer. Each is
waited on for health before the next starts; all of them are stopped (SIGTERM, then SIGKILL)
at the end or on Ctrl-C. Logs go to ``RUN_DIR/logs/<service>.log``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

from rich.console import Console

from services.config import load_config
from services.launch import (
    free_port,
    serve_command,
    start_engine_process,
    start_service_process,
    stop_process,
)


def _tail_metrics(path: Path, seen: int) -> tuple[list[dict], int]:
    if not path.exists():
        return [], seen
    lines = path.read_text().splitlines()
    return [json.loads(x) for x in lines[seen:]], len(lines)


async def heldout_accuracy(proxy_address: str, cfg) -> float:
    """Greedy answers of the held-out prompts, scored by the task's reward: share fully correct."""
    from transformers import AutoTokenizer

    from rollout.envs import load_jsonl
    from rollout.episode import render_user_turn
    from rollout.rewards import resolve_reward
    from services.llm_proxy.client import ProxyClient

    rows = load_jsonl(cfg.run.heldout_path)
    tok = AutoTokenizer.from_pretrained(cfg.env_manager.tokenizer_path)
    reward = resolve_reward(cfg.env_manager.reward)
    client = ProxyClient(proxy_address)
    try:
        outs = await asyncio.gather(
            *(
                client.generate(
                    render_user_turn(tok, r["prompt"]),
                    cfg.env_manager.episode.max_new_tokens,
                    temperature=0.0,
                    timeout_s=60,
                )  # fmt: skip
                for r in rows
            )
        )
    finally:
        await client.close()
    scores = [reward(tok.decode(o.output_ids, skip_special_tokens=True), r["answer"]) for o, r in zip(outs, rows)]
    return sum(s >= 1.0 for s in scores) / len(scores)


def plot_rewards(metrics: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m["step"] for m in metrics], [m["reward_mean"] for m in metrics])
    ax.set_xlabel("step")
    ax.set_ylabel("reward mean")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def run_mesh(config_path: Path, overrides: list[str]) -> int:
    cfg = load_config(config_path, overrides)
    console = Console()

    def _on_sigterm(signum, frame):  # stop the mesh on SIGTERM as on Ctrl-C, never leave orphans
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_sigterm)
    run_dir = Path(cfg.train_loop.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    logs = run_dir / "logs"
    procs: list[subprocess.Popen] = []
    t0 = time.time()
    common = [*overrides]
    try:
        engine_urls = []
        for _ in range(cfg.run.num_engines):
            proc, url = start_engine_process(
                cfg.engine.model_path, free_port(), common, cfg.run.startup_timeout_s, str(config_path)
            )
            procs.append(proc)
            engine_urls.append(url)
        console.print(f"[green]engines[/] {', '.join(engine_urls)}")
        up = dict(config_path=str(config_path), timeout_s=cfg.run.startup_timeout_s)
        proc, proxy_addr = start_service_process(
            "llm-proxy", "proxy", [*common, f"proxy.engine_urls=[{','.join(engine_urls)}]", "proxy.metrics_port=0"],
            log_path=logs / "proxy.log", **up,
        )  # fmt: skip
        procs.append(proc)
        proc, buffer_addr = start_service_process(
            "sample-buffer", "buffer", [*common, "buffer.metrics_port=0"], log_path=logs / "buffer.log", **up
        )
        procs.append(proc)
        ctl_overrides = [*common, f"controller.proxy_address={proxy_addr}", "controller.metrics_port=0"]
        proc, ctl_addr = start_service_process(
            "controller", "controller", ctl_overrides, log_path=logs / "controller.log", **up
        )
        procs.append(proc)
        wiring = [f"env_manager.proxy_address={proxy_addr}", f"env_manager.buffer_address={buffer_addr}",
                  f"env_manager.controller_address={ctl_addr}"]  # fmt: skip
        proc, _ = start_service_process(
            "env-manager", "env_manager", [*common, *wiring, "env_manager.metrics_port=0"],
            log_path=logs / "env_manager.log", **up,
        )  # fmt: skip
        procs.append(proc)
        console.print(f"[green]mesh up[/] proxy {proxy_addr}, buffer {buffer_addr}, controller {ctl_addr}")
        trainer = subprocess.Popen(
            serve_command("trainer", "trainer", [*common, *wiring], str(config_path)),
            stdout=open(logs / "trainer.log", "ab"),  # noqa: SIM115 (closed with the process)
            stderr=subprocess.STDOUT,
        )
        procs.append(trainer)
        seen, history = 0, []
        while trainer.poll() is None:
            time.sleep(1.0)
            new, seen = _tail_metrics(run_dir / "metrics.jsonl", seen)
            history += new
            for m in new:
                console.print(
                    f"step {m['step']:4d}  reward {m['reward_mean']:.3f}  loss {m['loss']:+.4f}  "
                    f"staleness max {m['staleness_max']}  {m['tokens'] / max(m['time_train_s'], 1e-9):,.0f} tok/s train"
                )
        if trainer.returncode != 0:
            console.print(f"[red]trainer exited with {trainer.returncode}[/]: see {logs / 'trainer.log'}")
            return trainer.returncode
        new, seen = _tail_metrics(run_dir / "metrics.jsonl", seen)
        history += new
        if history:
            plot_rewards(history, run_dir / "reward_curve.png")
        acc = asyncio.run(heldout_accuracy(proxy_addr, cfg)) if cfg.run.heldout_path else float("nan")
        last5 = [m["reward_mean"] for m in history[-5:]]
        reward_last5 = sum(last5) / max(1, len(last5))
        print(
            f"final: steps={len(history)} reward_mean_last5={reward_last5:.3f} heldout_accuracy={acc:.3f} "
            f"wall_s={time.time() - t0:.1f}",
            flush=True,
        )
        return 0
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping the mesh[/]")
        return 130
    finally:
        for p in reversed(procs):
            stop_process(p)
