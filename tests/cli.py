"""``rollmesh ...`` run inside the test's process: for a command that should refuse its options at
once, where a subprocess would only pay the imports again."""

from __future__ import annotations

from typer.testing import CliRunner, Result


def rollmesh(*args: str) -> Result:
    from launch.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])
