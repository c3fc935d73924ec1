"""The mesh's teachers (on-policy distillation): each a model behind engines and an LLMProxy of its
own, started by ``rollmesh run`` beside the policy's (``launch/mesh.py``), reached by the EnvManager
at ``mesh.teachers.<name>``. A teacher scores the student's tokens as they are, so it must read them
with the student's vocabulary: ``same_vocabulary`` refuses, by name, a teacher whose tokenizer differs
(a cross-tokenizer mapping is not built)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from sample_buffer.trajectory import DOMAIN_NAME


class TeacherConfig(BaseModel):
    """One teacher: its model, served by engines of the run's engine section."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        ...,
        pattern=f"^{DOMAIN_NAME.pattern}$",
        min_length=1,
        description="What a task's teacher key names it by (letters, digits, '_', '.', '-').",
    )
    model_path: str = Field(..., description="The teacher's model directory (a local path; nothing is downloaded).")
    num_engines: int = Field(1, ge=1, description="Engines serving it, behind its own LLMProxy.")


def _vocabulary(path: str) -> dict[str, int]:
    """A model directory's token → id map, from its tokenizer.json where it has one (fast), else
    through transformers."""
    file = Path(path) / "tokenizer.json"
    if file.exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True).get_vocab()


def vocabulary_problem(student: str, teacher: TeacherConfig) -> str | None:
    """Why ``teacher`` cannot score ``student``'s tokens (another vocabulary, or none to read), or None."""
    try:
        mine, theirs = _vocabulary(student), _vocabulary(teacher.model_path)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        return f"teachers[{teacher.name}].model_path: no tokenizer to compare with the student's: {e}"
    if mine == theirs:
        return None
    differ = sorted(set(mine.items()) ^ set(theirs.items()))
    example = f" (e.g. {differ[0][0]!r})" if differ else ""
    return (
        f"teachers[{teacher.name}]: its tokenizer's vocabulary ({len(theirs)} tokens) is not the student's "
        f"({len(mine)}){example}: a teacher scores the student's token ids as they are, and a cross-tokenizer "
        "mapping is not built"
    )
