"""The ``rollmesh`` command line: ``rollmesh run CONFIG`` trains (``launch/run.py`` reads top to
bottom: config, mesh, evaluation, trainer, summary); the other subcommands live in
``launch/commands/``. Each parses its options, then imports the heavy modules, then runs."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path

import typer

from launch.commands import bench, data, launch, serve
from launch.commands.common import SetOpt, load_or_exit

# Plain tracebacks: services write to log files, where rich's boxes (80 columns, with source) bury
# the error, and `rollmesh run` shows a dying service's last lines, which must be the error's.
app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="rollmesh: asynchronous RL post-training mesh",
)
app.command("make-dataset")(data.make_dataset)
app.command("init-model")(data.init_model)
app.add_typer(serve.app, name="serve")
app.add_typer(bench.app, name="bench")
app.add_typer(launch.app, name="launch")


class Launcher(StrEnum):
    local = "local"
    slurm = "slurm"


@app.command()
def run(
    config: Path = typer.Argument(..., help="Run config (YAML)."),
    set_: list[str] = SetOpt,
    fresh: bool = typer.Option(False, "--fresh", help="Delete the run directory's checkpoints instead of resuming."),
    launcher: Launcher = typer.Option(
        Launcher.local,
        help="local: every process here; slurm: job steps of the SLURM job this runs in (`rollmesh launch slurm`).",
    ),
) -> None:
    """Start the whole mesh locally, train, evaluate, shut down; prints a final summary line."""
    load_or_exit(config, set_)  # fail fast on a bad config, before any process starts
    from launch.run import run_mesh

    raise typer.Exit(run_mesh(config, set_, fresh, launcher.value))


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
        from launch.config_docs import write

        typer.echo(f"wrote {write(out)}")
        return
    if show is None:
        typer.echo("error: give --show CONFIG (with any --set) or --docs", err=True)
        raise typer.Exit(2)
    # Secrets print masked (SecretStr), never as given.
    typer.echo(yaml.safe_dump(load_or_exit(show, set_).model_dump(mode="json"), sort_keys=False), nl=False)


@app.command()
def compare(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories (`train_loop.run_dir` of `rollmesh run`)."),
    out: Path | None = typer.Option(None, "--out", help="PNG: reward against steps and against wall time."),
    window: int = typer.Option(5, min=1, help="Steps in the trailing mean the plot draws."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON line last."),
) -> None:
    """Runs side by side: reward by quarter of the run, held-out before/after, wall time."""
    from launch.compare import RunMissing
    from launch.compare import compare as compare_runs

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
def health(
    address: str = typer.Argument(..., help="host:port of a gRPC service, or an HTTP base URL with --http."),
    http: bool = typer.Option(False, "--http", help="An HTTP service (engine, gateway): GET ADDRESS/health."),
    timeout_s: float = typer.Option(3.0, "--timeout-s", min=0.1, help="How long to wait for SERVING / 200."),
    config: Path = typer.Option(None, "--config", help="The run config: its auth.tls (a TLS mesh) is spoken."),
    set_: list[str] = SetOpt,
) -> None:
    """Exit 0 if the service answers healthy within the timeout, else 1 (containers' health checks;
    health needs no token, but a TLS service needs its CA: --config or --set auth.tls.ca_path=...)."""
    from services.processes import wait_grpc_healthy, wait_http_healthy

    auth = load_or_exit(config, set_).auth if config is not None or set_ else None
    try:
        if http:
            wait_http_healthy(address.rstrip("/") + "/health", timeout_s, auth=auth)
        else:
            wait_grpc_healthy(address, timeout_s, auth=auth)
    except TimeoutError as e:
        typer.echo(f"unhealthy: {e}", err=True)
        raise typer.Exit(1) from None


@app.command("gateway-key")
def gateway_key(
    file: Path = typer.Argument(..., help="The gateway's key file (gateway.api_keys_path); made if absent."),
    name: str = typer.Argument(..., help="Whose key: an agent or tenant (its sessions are its own)."),
    revoke: bool = typer.Option(False, "--revoke", help="Delete NAME's key instead of issuing one."),
    tinker: bool = typer.Option(False, "--tinker", help="A key the tinker SDK takes (tml-...): tinker.api_keys_path."),
) -> None:
    """Issue an agent (or a Tinker user) a key (printed once; the file keeps only its hash), or revoke one."""
    from services.gateway.keys import issue_key, revoke_key

    if revoke:
        if not revoke_key(file, name):
            typer.echo(f"gateway-key: no key named {name!r} in {file}", err=True)
            raise typer.Exit(2)
        typer.echo(f"revoked {name!r}: the gateway refuses it within a second")
        return
    print(issue_key(file, name, prefix="tml-" if tinker else "rk-"))


@app.command()
def demo(model: Path = typer.Option(Path("models/tiny"), help="Model directory.")) -> None:
    """Inference demo: an embedded engine behind the LLMProxy answering a few chat prompts."""
    import asyncio

    from launch.demo import run_demo
    from services.auth import AuthConfig, ensure_token

    ensure_token(AuthConfig())

    asyncio.run(run_demo(str(model)))


if __name__ == "__main__":
    app()
