"""``env: {type: verifiers}``: an environment written with the ``verifiers`` library (prime-rl's
Environments Hub), run unchanged by its own code. It is not an ``Env`` of this process: verifiers'
dependencies (mcp<2, its openai and datasets pins) cannot share the mesh's venv, so ``rollmesh run``
starts the environment's driver (``services/verifiers_driver/``) in the venv named here, against
the agent gateway in place of the EnvManager; see docs/workflows.md."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class VerifiersEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["verifiers"] = Field("verifiers", description="Selects a verifiers environment.")
    name: str = Field(
        ...,
        min_length=1,
        description="What verifiers.load_environment loads: an installed environment package's name, or a module "
        "on one of path's folders.",
    )
    args: dict = Field(default_factory=dict, description="Keyword arguments of the environment's load_environment.")
    path: list[str] = Field(default_factory=list, description="Folders put first on the environment's sys.path.")
    python: str = Field(
        ".venv-verifiers/bin/python",
        min_length=1,
        description="The interpreter of the environment's venv (verifiers<0.4, the classic Environment API, and "
        "the environment's own packages; `make verifiers` builds the default).",
    )
    concurrency: int = Field(8, ge=1, le=1024, description="Groups the driver plays at once.")

    def build(self, rows=None, reward_fn=None):
        raise ValueError(
            "env.type verifiers: the environment runs in its own venv against the agent gateway (rollmesh run "
            "starts it); an EnvManager cannot run it"
        )
