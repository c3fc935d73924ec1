"""Constrained decoding's shared terms: the grammar params (SGLang's names), their bound, and the two
readings the engine that masks and the trainer that replays must make alike — a grammar compiled
from its text, and the model's stop tokens (a finished answer may end with any of them) — so that
both build the same masks.

xgrammar is not imported here: the callers pass its compiler.
"""

from __future__ import annotations

# The sampling params a grammar comes in, and the longest text one may have (a tool-call schema is a
# few KB; xgrammar's compile time grows with it). A turn decoded under one records it
# (``Trajectory.metadata["turn_grammars"]``), so the trainer replays its masks.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
MAX_GRAMMAR_CHARS = 65_536


def compile_grammar(compiler, field: str, text: str):
    """``text`` compiled by xgrammar's ``compiler`` as ``field`` (one of ``GRAMMAR_FIELDS``) says."""
    if field == "json_schema":
        return compiler.compile_json_schema(text, strict_mode=True)
    if field == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)


def stop_token_ids(model_path: str) -> frozenset[int]:
    """The tokens a generation of the model at ``model_path`` ends at: its generation config's
    ``eos_token_id`` (the model config's where it has none)."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path, local_files_only=True).eos_token_id
    except OSError:  # no generation_config.json: fall back to the model config
        from transformers import AutoConfig

        eos = AutoConfig.from_pretrained(model_path, local_files_only=True).eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
