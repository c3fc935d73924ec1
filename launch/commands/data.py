"""``rollmesh make-dataset`` and ``rollmesh init-model``: what a run reads, made locally (registered
in ``launch/cli.py``)."""

from __future__ import annotations

from pathlib import Path

import typer


def make_dataset(
    task: str = typer.Argument(
        ...,
        help="A reasoning-gym task (chain_sum, basic_arithmetic, gsm_symbolic, ...), humaneval or code_tasks "
        "(code tasks for reward type code), or word_count (format tasks for the word_count reward).",
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
    from rollout.envs.generated import generate_rows
    from rollout.envs.reasoning_gym_data import DatasetError, parse_value, write_jsonl

    bad = [p for p in param if "=" not in p]
    if bad:
        typer.echo(f"make-dataset: --param: expected key=value, got {bad[0]!r}", err=True)
        raise typer.Exit(2)
    options = {k: parse_value(v) for k, v in (p.split("=", 1) for p in param)}
    try:
        rows = generate_rows(task, size, seed, **options)
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


def init_model(
    out: Path = typer.Option(..., "--out", help="Directory to write the Hugging Face model into."),
    source: str | None = typer.Option(
        None,
        "--from",
        help="A pretrained model from an installed package (smollm2-135m-instruct) instead of the tiny one.",
    ),
    arch: str = typer.Option(
        "qwen2",
        help="qwen2 (dense), qwen3-moe (a mixture of experts in every layer), qwen2-vl or llava (with a vision tower).",
    ),
    seed: int = typer.Option(0, help="Seed of the random initialisation."),
    hidden_size: int = typer.Option(128, help="Width of the residual stream."),
    num_layers: int = typer.Option(4, help="Decoder layers."),
    digit_prior_steps: int = typer.Option(
        0, help="Format-only warm-up steps: the model learns to answer with one digit, not which one."
    ),
    glyph_prior_steps: int = typer.Option(
        0, help="Vision models: steps of naming letters in pictures first (a tower that reads shapes, no digits)."
    ),
    patch_size: int = typer.Option(4, help="Vision models: pixels per patch side."),
    vision_width: int = typer.Option(32, help="qwen2-vl: width of the vision tower."),
) -> None:
    """Build the tiny Qwen2 (or Qwen3-MoE, or Qwen2-VL) model and tokenizer locally, or convert a packaged
    pretrained model (no download)."""
    from transformers import AutoModelForCausalLM

    from sample_buffer.vision import model_class
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
    try:
        cfg = TinyModelConfig(
            arch=arch,
            seed=seed,
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            digit_prior_steps=digit_prior_steps,
            glyph_prior_steps=glyph_prior_steps,
            patch_size=patch_size,
            vision_embed_dim=vision_width,
        )
    except ValueError as e:
        typer.echo(f"init-model: {e}", err=True)
        raise typer.Exit(2) from None
    from rollout.envs.digit_pictures import prior_prompt

    path = build_tiny_model(out, cfg, pictures=prior_prompt)
    n = count_parameters(model_class(path).from_pretrained(path))
    typer.echo(f"wrote {path} ({n / 1e6:.2f} M parameters)")
