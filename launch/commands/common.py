"""What the subcommands share: the config options, loading a run config, bench output."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer

ConfigOpt = typer.Option(None, "--config", "-c", help="YAML run config (defaults when omitted).")
SetOpt = typer.Option([], "--set", help="Override a config key, e.g. --set engine.port=30001 (repeatable).")


def load_or_exit(config: Path | None, overrides: list[str]):
    from launch.config import ConfigError, load_config

    try:
        return load_config(config, overrides)
    except ConfigError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2) from None


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def checked(fn, *args):
    """``fn(*args)``; a bad option value (``BadOption`` naming it) exits 2 with the message, no traceback."""
    from launch.bench import BadOption

    try:
        return fn(*args)
    except BadOption as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def progress_printer(as_json: bool):
    import sys

    def progress(line: str) -> None:
        print(line, file=sys.stderr if as_json else sys.stdout, flush=True)

    return progress


def emit(result: dict, as_json: bool) -> None:
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
