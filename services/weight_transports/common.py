"""What every weight transport shares: reading the engines' replies (the trainer's side) and what
the embedded engine's server hands each transport's receiving routes (the engine's side)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field


def engine_failures(res) -> str:
    """The engines' errors of an UpdateWeights* reply, one clause each."""
    return "; ".join(f"{e.engine or 'proxy'}: {e.message}" for e in res.engines if not e.success)


# Versions travel as int64 (the LLMProxy's protobuf messages): a larger one made every later response fail.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass
class EngineSide:
    """What a transport's receiving routes need of the embedded engine's server."""

    engine: Any  # the EmbeddedEngine (or the latency simulator)
    parse_version: Callable[[str | int | None], int | None]  # a request's weight_version, checked
    load_roots: list[str] = field(default_factory=list)  # where /update_weights_from_disk may load from


def held_checksum(state: dict, dtype: str) -> str:
    """The checksum of ``state`` as engines holding ``dtype`` compute it (``weights_checksum``):
    what an update that sends less than every weight must leave them with."""
    import torch

    from rollout.engines import weight_delta
    from rollout.engines.embedded.weights import weights_checksum

    return weights_checksum(weight_delta.cast(state, getattr(torch, dtype)))


def failed(message: str):
    """A receive that failed on the engine's side (a peer, a file): 500, SGLang's shape."""
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=500, content={"success": False, "message": message})


class AdapterFields(BaseModel):
    """rollmesh's fields on SGLang's tensor and distributed update requests: an adapter-only update
    of a LoRA policy, whose factors the engine merges into its base weights."""

    adapter: bool = Field(
        False,
        description="rollmesh: the tensors are a LoRA policy's factors (rollout/engines/embedded/adapter_sync.py), "
        "merged into the engine's base weights.",
    )
    checksum: str = Field(
        "", max_length=64, description="rollmesh, an adapter update's last bucket: the checksum of the result."
    )

    def check_adapter(self, engine, version: int | None) -> None:
        """``EngineError`` naming the field if this engine cannot take the adapter update asked for."""
        from rollout.engines.contract import EngineError

        if self.adapter and not hasattr(engine, "stage_adapter"):
            raise EngineError("adapter", "this engine applies no adapter-only updates")
        if self.adapter and version is not None and not self.checksum:
            raise EngineError("checksum", "an adapter update's last bucket carries the checksum of the result")
