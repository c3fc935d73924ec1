"""`rollmesh launch slurm CONFIG`: submit the mesh to a cluster's scheduler (launch/slurm.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from launch.commands.common import SetOpt, load_or_exit

app = typer.Typer(no_args_is_help=True, help="Run the mesh as a cluster job.")


@app.command("slurm")
def slurm_(
    config: Path = typer.Argument(..., help="Run config (YAML); its `slurm:` section shapes the job."),
    set_: list[str] = SetOpt,
    fresh: bool = typer.Option(False, "--fresh", help="Delete the run directory's checkpoints instead of resuming."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Write the batch script and print it; submit nothing."),
) -> None:
    """Write RUN_DIR/slurm/job.sh (every service a job step) and submit it with sbatch; prints the job id."""
    cfg = load_or_exit(config, set_)
    from launch.slurm import SlurmError, submit

    try:
        job, script = submit(cfg, config, set_, fresh, dry_run)
    except ValueError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2) from None
    except SlurmError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    if dry_run:
        typer.echo(script.read_text(), nl=False)
        return
    folder = script.parent
    typer.echo(f"submitted job {job}: {script}")
    typer.echo(f"  progress: {folder / f'job-{job}.out'}; each service's log: {folder.parent / 'logs'}")
    typer.echo(f"  stop it: scancel {job}")
    print(job)
