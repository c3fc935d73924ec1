"""``rollmesh bench NAME``: the benchmarks; each prints a table, and with --json one JSON line last."""

from __future__ import annotations

from pathlib import Path

import typer

from launch.commands.common import checked, emit, load_or_exit, progress_printer
from rollout.envs.remote import PROTOCOLS

app = typer.Typer(no_args_is_help=True, help="Benchmarks; each prints a JSON line last.")


@app.callback()
def _bench_token() -> None:
    """Benchmarks start their own services: one token for all of them, like `rollmesh run`."""
    from services.auth import AuthConfig, ensure_token

    ensure_token(AuthConfig())


@app.command("engine")
def bench_engine(
    model: Path = typer.Option(Path("models/tiny"), help="Model directory."),
    num_prompts: int = typer.Option(256, help="Prompts to generate for."),
    max_new_tokens: int = typer.Option(128, help="Longest response, in tokens."),
    batch_size: int = typer.Option(64, help="Running batch (engines) and static batch (HF generate)."),
    vllm: bool = typer.Option(True, "--vllm/--no-vllm", help="Include vLLM (from `make vllm`'s environment)."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Embedded engine and vLLM (continuous batching) vs HF generate (static batches) on long-tailed
    lengths, with each engine's log-prob mismatch against a teacher-forced forward."""
    from launch.bench.engine_bench import run

    emit(checked(run, str(model), num_prompts, max_new_tokens, batch_size, vllm, progress_printer(json_)), json_)


@app.command("grammar")
def bench_grammar(
    model: Path = typer.Option(
        Path("models/smollm2"),
        help="Model directory (a chat model; SmolLM2: `rollmesh init-model --from smollm2-135m-instruct`).",
    ),
    num_prompts: int = typer.Option(32, help="Prompts, each sampled once plain and once under the schema."),
    max_new_tokens: int = typer.Option(64, help="Tokens per answer at most."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Constrained decoding (a tool call's JSON schema) vs plain sampling in the embedded engine:
    tokens/s, masking time per step, compile time, valid answers, the cost of replaying the masks."""
    from launch.bench.grammar_bench import run

    emit(checked(run, str(model), num_prompts, max_new_tokens, progress_printer(json_)), json_)


@app.command("proxy")
def bench_proxy(
    model: Path = typer.Option(Path("models/tiny"), help="Model directory."),
    clients: int = typer.Option(64, help="Concurrent clients."),
    requests_per_client: int = typer.Option(20, help="Sequential 1-token requests per client."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Latency the LLMProxy adds over calling the engine directly (1-token generations)."""
    from launch.bench.proxy_bench import run

    emit(run(str(model), clients, requests_per_client), json_)


@app.command("gateway")
def bench_gateway(
    model: Path = typer.Option(Path("models/tiny"), help="Model directory (engine and chat template)."),
    clients: int = typer.Option(200, help="Concurrent agents."),
    duration_s: float = typer.Option(60.0, help="Seconds of load each way (straight to the proxy, via the gateway)."),
    turns: int = typer.Option(3, help="Turns per session (each resends the history)."),
    max_tokens: int = typer.Option(4, help="Tokens generated per turn."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Many agents' multi-turn sessions through the agent gateway vs straight to the LLMProxy: errors,
    added latency, prompt tokens rendered vs reused by prefix aggregation."""
    from launch.bench.gateway_bench import run

    emit(checked(run, str(model), clients, duration_s, turns, max_tokens, progress_printer(json_)), json_)


@app.command("buffer")
def bench_buffer(
    groups: int = typer.Option(20_000, help="Groups to put and get."),
    group_size: int = typer.Option(8, help="Trajectories per group."),
    tokens: int = typer.Option(512, help="Tokens per trajectory."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Groups through the gRPC SampleBuffer backed by a local redis-server, vs raw Redis SET/GET."""
    from launch.bench.buffer_bench import run

    emit(run(groups, group_size, tokens), json_)


@app.command("vision")
def bench_vision(
    groups: int = typer.Option(2000, help="Groups to put and get, text-only and with a picture."),
    group_size: int = typer.Option(8, help="Trajectories per group."),
    tokens: int = typer.Option(512, help="Tokens per trajectory."),
    image_side: int = typer.Option(448, help="The picture's side in pixels (random pixels: a PNG's largest)."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Images through the SampleBuffer: bytes per group and groups/s with a picture per prompt vs text only."""
    from launch.bench.vision_bench import run

    emit(checked(run, groups, group_size, tokens, image_side, progress_printer(json_)), json_)


@app.command("moe")
def bench_moe(
    model: Path | None = typer.Option(None, help="An MoE model directory; default: the tiny Qwen3-MoE, random."),
    engine_dtype: str = typer.Option("bfloat16", help="The engine's dtype (the trainer's is float32)."),
    num_prompts: int = typer.Option(64, help="Answers to sample."),
    max_new_tokens: int = typer.Option(48, help="Tokens per answer."),
    groups: int = typer.Option(2000, help="Groups through the buffer, with and without routing (0: skip)."),
    routing_ids: int = typer.Option(384, help="Routing ids per token for the buffer part (Qwen3-30B-A3B: 48 x 8)."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Routing replay: the engine–trainer log-prob mismatch with and without it, and routing's cost."""
    from launch.bench.moe_bench import run

    model_path = None if model is None else str(model)
    args = (model_path, engine_dtype, num_prompts, max_new_tokens, groups, routing_ids, device)
    emit(checked(run, *args, progress_printer(json_)), json_)


@app.command("trainer")
def bench_trainer(
    model: Path | None = typer.Option(None, help="Model directory; default: a random model of --shape."),
    shape: str = typer.Option("tiny", help="Random model to build when no --model: tiny or qwen2-0.5b."),
    steps: int | None = typer.Option(None, help="Optimizer steps to time (default 20; with --workload 2 per layout)."),
    trajectories: int | None = typer.Option(
        None, help="Trajectories per step (default 256, in groups of 8; with --workload the workload's own)."
    ),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    mixed_precision: bool = typer.Option(False, "--mixed-precision", help="bfloat16 compute, float32 master weights."),
    activation_checkpointing: bool = typer.Option(False, "--activation-checkpointing", help="Recompute activations."),
    workload: str | None = typer.Option(
        None,
        help="grpo, agent, quickstart or all: time that workload unpacked, packed and tree-packed instead "
        "(on --model, default a random tiny model; --steps steps each, default 2).",
    ),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """GRPO training steps, with and without sequence packing: tokens/s, MFU and peak memory on a GPU."""
    from launch.bench.trainer_bench import run

    if workload is not None:
        from launch.bench.trainer_workloads import WORKLOADS

        fixed = dict(shape=shape != "tiny", device=device != "auto")
        fixed |= {"mixed-precision": mixed_precision, "activation-checkpointing": activation_checkpointing}
        if taken := [f"--{k}" for k, v in fixed.items() if v]:  # said, not silently ignored
            typer.echo(f"error: --workload: trains in float32 on the CPU, not with {', '.join(taken)}", err=True)
            raise typer.Exit(2)
        from launch.bench.trainer_workloads import run as run_workloads

        chosen = list(WORKLOADS) if workload == "all" else [workload]
        args = (chosen, 2 if steps is None else steps, progress_printer(json_), model and str(model), trajectories)
        emit(checked(run_workloads, *args), json_)
        return
    emit(
        checked(
            run,
            None if model is None else str(model),
            20 if steps is None else steps,
            256 if trajectories is None else trajectories,
            shape,
            device,
            mixed_precision,
            activation_checkpointing,
            progress_printer(json_),
        ),
        json_,
    )


@app.command("async")
def bench_async(
    model: Path = typer.Option(Path("models/tiny"), help="Tokenizer directory (prompts are rendered with it)."),
    steps: int = typer.Option(6, help="Measured training steps per scenario."),
    warmup: int = typer.Option(2, help="Steps before measuring (the pipeline fills)."),
    engines: int = typer.Option(2, help="Simulated engines (identical in every scenario)."),
    time_scale: float = typer.Option(25.0, help="Simulated seconds per wall second."),
    scenario: list[str] = typer.Option(
        [], "--scenario", help="Run only these (repeatable; also of --tail and --providers); default all."
    ),
    agentic: bool = typer.Option(True, help="Also run the agentic variant (sync_batch and async_2)."),
    keep: Path = typer.Option(None, help="Keep every scenario's config, logs and metrics.jsonl in this directory."),
    suspend_mode: str = typer.Option("in_place", help="controller.suspend_mode of every scenario: in_place|continue."),
    providers: bool = typer.Option(
        False,
        help="Instead: the agentic scenario with environments in provider processes, with and without "
        "injected faults and redundant rollout (~8 min).",
    ),
    groups_per_step: int = typer.Option(
        None, help="Groups (of 8) per training step; default 80, five times what the engines decode at once."
    ),
    tail: bool = typer.Option(
        False, help="Instead: tail batching (RollPacker) against plain synchronous, on prompt-correlated lengths."
    ),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Synchronous vs queue scheduling vs async_ratio 1/2/4 on the latency simulator (real services)."""
    from launch.bench.async_bench import DEFAULT_GROUPS_PER_STEP, run

    gps = DEFAULT_GROUPS_PER_STEP if groups_per_step is None else groups_per_step
    result = checked(
        run,
        str(model),
        steps,
        warmup,
        engines,
        time_scale,
        scenario or None,
        agentic,
        progress_printer(json_),
        keep,
        suspend_mode,
        gps,
        providers,
        tail,
    )
    emit(result, json_)


@app.command("providers")
def bench_providers(
    providers: list[int] = typer.Option([], "--providers", help="Provider processes per cell (repeatable); 1 4 16."),
    protocol: list[str] = typer.Option([], "--protocol", help=f"{', '.join(PROTOCOLS)} (repeatable); default all."),
    concurrency: int = typer.Option(64, help="Episodes stepping at once."),
    seconds: float = typer.Option(3.0, help="How long each cell steps."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Steps/s and step latency to environment providers, gRPC vs HTTP vs OpenEnv's WebSocket."""
    from launch.bench.providers_bench import run

    emit(
        checked(
            run, providers or [1, 4, 16], protocol or list(PROTOCOLS), concurrency, seconds, progress_printer(json_)
        ),
        json_,
    )


@app.command("reward")
def bench_reward(
    tasks: int = typer.Option(24, help="Code tasks."),
    per_task: int = typer.Option(8, help="Answers per task (a group)."),
    base_s: float = typer.Option(0.15, help="Typical run time of a task's right answer, s (tasks vary 0.3-1.7x)."),
    hang_share: float = typer.Option(0.05, help="Share of answers that never end (they meet the fixed timeout)."),
    fixed_s: float = typer.Option(3.0, help="The fixed timeout, s (RollPacker's 30 s, scaled down)."),
    t_min_s: float = typer.Option(0.5, help="Adaptive timeout: T_min, s."),
    lam: float = typer.Option(2.0, help="Adaptive timeout: lambda, the multiple of the anchor."),
    concurrency: int = typer.Option(2, help="Sandboxed runs at once."),
    seed: int = typer.Option(0, help="Seed of the workload."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Code sandbox seconds with a fixed vs the adaptive timeout; sandbox and math-verify throughput."""
    from launch.bench.reward_bench import run

    emit(
        checked(
            run, tasks, per_task, base_s, hang_share, fixed_s, t_min_s, lam, concurrency, seed, progress_printer(json_)
        ),
        json_,
    )


@app.command("ceiling")
def bench_ceiling(
    config: Path = typer.Option(None, help="Take the workload from this run config (a sim engine and trainer, sizes)."),
    groups_per_step: list[int] = typer.Option(
        [], "--groups-per-step", help="Step sizes (repeatable); default 16 32 48 64 80."
    ),
    async_ratio: list[int] = typer.Option([], "--async-ratio", help="Ratios to play (repeatable); default 1 2 4."),
    engines: int = typer.Option(None, help="Engines (default: the config's run.num_engines, else 2)."),
    target: float = typer.Option(0.85, help="Efficiency to find the smallest async_ratio for."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Which async_ratio does a workload need? The admission rules played with zero overhead."""
    from launch.bench.ceiling_bench import plan

    cfg = load_or_exit(config, []) if config else None
    emit(
        checked(
            plan,
            cfg,
            groups_per_step or [16, 32, 48, 64, 80],
            async_ratio or [1, 2, 4],
            engines,
            target,
            progress_printer(json_),
        ),
        json_,
    )


@app.command("weights")
def bench_weights(
    hidden_size: int = typer.Option(1024, help="Width of the random model (0.4 GB at the default shape)."),
    layers: int = typer.Option(8, help="Decoder layers of the random model."),
    engines: int = typer.Option(2, help="Engine processes behind the proxy."),
    repeats: int = typer.Option(3, help="Updates per transport (the median is reported)."),
    bucket_mb: int = typer.Option(256, help="http_buckets, ipc and collective: largest bucket in MiB."),
    delta: bool = typer.Option(
        False,
        "--delta",
        help="Instead: whole vs delta updates (http_buckets, delta: true) after each of --steps real training "
        "steps of --config's model and trainer, to two bfloat16 engines.",
    ),
    config: Path = typer.Option(Path("examples/smollm2-math.yaml"), help="--delta: the run config trained."),
    steps: int = typer.Option(10, help="--delta: training steps (the first update is whole on both sides)."),
    lora_rank: int = typer.Option(
        0, help="--delta: train LoRA adapters of this rank, and send their factors alone to a third engine too."
    ),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """One weight update through each CPU transport (disk, http_buckets, ipc, collective/gloo): seconds, GB/s."""
    if delta:
        from launch.bench.weights_delta import run as run_delta

        fixed = {"hidden-size": hidden_size != 1024, "layers": layers != 8, "engines": engines != 2}
        if taken := [f"--{k}" for k, v in fixed.items() if v] + (["--repeats"] if repeats != 3 else []):
            typer.echo(
                f"error: --delta: trains the config's model on two engines, not with {', '.join(taken)}", err=True
            )
            raise typer.Exit(2)
        emit(checked(run_delta, str(config), steps, 4, bucket_mb, progress_printer(json_), lora_rank), json_)
        return
    from launch.bench.weights_bench import run

    emit(checked(run, hidden_size, layers, engines, repeats, bucket_mb, progress_printer(json_)), json_)


@app.command("peers")
def bench_peers(
    task: list[str] = typer.Option(
        ["quickstart", "math"], "--task", help="Tasks to run (repeatable): quickstart, math (SmolLM2)."
    ),
    steps: int = typer.Option(None, help="Steps of each task (default: the task's own: 300, 10)."),
    seed: int = typer.Option(0, help="Seed of both sides (prompt order, sampling, initialisation)."),
    out: Path = typer.Option(None, help="Also write the result here (docs/bench/peers.json)."),
    peers_venv: Path = typer.Option(Path(".venv-peers"), help="TRL's environment (built here on first use)."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """rollmesh against TRL's GRPOTrainer, side by side on the same tasks: seconds a step, time to the
    held-out target, tokens/s, CPU per process, where a rollmesh step's time goes, the FLOP floor."""
    from launch.bench.peers_bench import PeersUnavailable, run

    try:
        result = checked(run, task, seed, steps, out, peers_venv, progress_printer(json_))
    except PeersUnavailable as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    emit(_peers_summary(result), json_)


def _peers_summary(result: dict) -> dict:
    """The table's rows (per task: each side's step time and the ratios); the details in the JSON."""
    rows: dict = {}
    for name, t in result["tasks"].items():
        rows[f"{name}.trl_wall_s"] = t["trl"]["train_wall_s"]
        rows[f"{name}.rollmesh_wall_s"] = t["rollmesh"]["train_wall_s"]
        rows[f"{name}.wall_speedup_same_steps"] = t["wall_speedup_same_steps"]
        rows[f"{name}.step_speedup_median"] = t["step_speedup"]
        if "time_to_target_speedup" in t:
            rows[f"{name}.time_to_target_speedup"] = t["time_to_target_speedup"]
        rows[f"{name}.heldout_after_trl"] = t["heldout_after"]["trl"]
        rows[f"{name}.heldout_after_rollmesh"] = t["heldout_after"]["rollmesh"]
    return rows | {"details": result}


@app.command("distill")
def bench_distill(
    variant: list[str] = typer.Option(
        [], "--variant", help="Variants (repeatable): grpo, grpo+opd, top8, grpo+top8, top8/g1; default: all."
    ),
    seeds: int = typer.Option(3, help="Runs per variant, seeds 0..n-1."),
    steps: int = typer.Option(100, help="Training steps of each run."),
    eval_every: int = typer.Option(10, help="Held-out evaluation every this many steps."),
    target: float = typer.Option(0.8, help="The held-out accuracy whose first step is counted."),
    teacher: str = typer.Option("runs/quickstart/weights/v300", help="The teacher: the quickstart's policy."),
    out: Path = typer.Option(Path("runs/bench-distill"), help="Where the runs, their logs and result.json go."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """On-policy distillation against GRPO alone on the digit task, side by side over seeds: the steps
    and training seconds to the held-out target, and each variant's steps as a share of GRPO's."""
    from launch.bench.distill_bench import run

    result = checked(run, variant or None, seeds, steps, eval_every, target, teacher, str(out), progress_printer(json_))
    emit(result, json_)


@app.command("chaos")
def bench_chaos(
    model: Path = typer.Option(Path("models/tiny"), help="Model directory (make model builds models/tiny)."),
    service: list[str] = typer.Option(
        [], "--service", help="Services to kill, in order (repeatable); default: all seven."
    ),
    steps_between: int = typer.Option(2, help="Training steps before each kill."),
    seed: int = typer.Option(0, help="Seed of the kill moments."),
    baseline: bool = typer.Option(True, help="Also time the same run undisturbed (the slowdown)."),
    keep: Path = typer.Option(None, help="Keep both runs' output, logs and metrics in this (new) directory."),
    teacher: bool = typer.Option(False, help="Distill from a teacher, whose engine and proxy are killed too."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Kill each service once mid-run: seconds to the next step, groups lost and trained twice."""
    from launch.bench.chaos_bench import run

    emit(
        checked(
            run,
            str(model),
            service,
            steps_between,
            seed,
            baseline,
            progress_printer(json_),
            str(keep) if keep else None,
            None,
            teacher,
        ),
        json_,
    )


@app.command("offpolicy")
def bench_offpolicy(
    example: str = typer.Option(
        "quickstart", help="quickstart (tiny model, 100 steps), smollm2-math (40) or moe-quickstart (tiny MoE, 100)."
    ),
    model: Path = typer.Option(None, help="The example's model; default models/tiny-digits or models/smollm2."),
    loss: list[str] = typer.Option([], "--loss", help="Losses to compare (repeatable); default: all of them."),
    ratio: list[int] = typer.Option([], "--ratio", help="Async ratios (repeatable); default: 0, 2 and 8."),
    lr: list[float] = typer.Option([], "--lr", help="Learning rates (repeatable); default: the example's."),
    steps: int = typer.Option(None, help="Training steps of each run; default: the example's bench length."),
    seeds: int = typer.Option(1, help="Runs per combination, seeds 0..n-1 (the spread says what is noise)."),
    first_seed: int = typer.Option(0, help="The first seed: a study goes on where an earlier run stopped."),
    audit: bool = typer.Option(False, help="Measure the per-step KL and check μ (trainer.audit_versions 2)."),
    out: Path = typer.Option(Path("runs/bench-offpolicy"), help="Where the plot and the full results go."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Each loss at each async ratio (and learning rate): reward per step and per generating version,
    held-out accuracy, per-step policy movement, which prompts were trained, wall time, plot."""
    from launch.bench.offpolicy_bench import run

    result = checked(
        run,
        str(model) if model else None,
        loss or None,
        ratio or None,
        steps,
        seeds,
        str(out),
        progress_printer(json_),
        lr or None,
        example,
        audit,
        first_seed,
    )
    emit(result, json_)


@app.command("domains")
def bench_domains(
    model: Path = typer.Option(Path("models/tiny"), help="Tokenizer directory (prompts are rendered with it)."),
    steps: int = typer.Option(20, help="Training steps of each run (the first --warmup are not measured)."),
    warmup: int = typer.Option(3, help="Steps before measuring (the pipeline fills)."),
    groups_per_step: int = typer.Option(10, help="Groups (of 4) per training step."),
    time_scale: float = typer.Option(50.0, help="Simulated seconds per wall second."),
    compare: bool = typer.Option(
        True, help="Also run the domains with batches oldest first, and the fast domain alone (to compare with)."
    ),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Three domains with 0.1 s, 2 s and 20 s rewards at weights 0.5/0.3/0.2, async_ratio 2, on the latency
    simulator (real services): each domain's share of every batch, and the step time against one domain."""
    from launch.bench.domains_bench import run

    emit(checked(run, str(model), steps, warmup, groups_per_step, time_scale, compare, progress_printer(json_)), json_)


@app.command("gpu")
def bench_gpu(
    steps: int = typer.Option(5, help="Training steps to time (packed and unpacked)."),
    num_prompts: int = typer.Option(256, help="Prompts the engine and generate answer."),
    max_new_tokens: int = typer.Option(128, help="Longest response, in tokens."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """The GPU path on a Qwen2-0.5B-shaped model (`make gpu-check`): a bf16 training step, the engine
    on CUDA vs generate, CUDA-IPC and NCCL weight updates. Exits 2 without CUDA, 1 if a part failed."""
    from launch.bench.gpu_check import NoCuda, run

    try:
        result = checked(run, steps, num_prompts, max_new_tokens, progress_printer(json_))
    except NoCuda as e:
        typer.echo(f"gpu-check: {e}; run it on a machine with a CUDA GPU and torch's CUDA build", err=True)
        raise typer.Exit(2) from None
    emit(result, json_)
    if result["failed_sections"]:
        raise typer.Exit(1)
