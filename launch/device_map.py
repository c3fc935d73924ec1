"""Which GPUs serve engines and which train (ROLL's device mapping), checked before anything starts.

``devices.placement``:

- ``none`` (default): nothing is pinned (CPU, or each process takes what CUDA gives it);
- ``disaggregated``: engines and trainer on disjoint GPUs; both run all the time (async RL);
- ``colocated``: engines and trainer share the same GPUs; the trainer has the engines release
  their GPU memory (weights and KV cache) while it trains and restore it after (ROLL's and
  verl's hybrid engine).

``rollmesh run`` turns the map into each process's ``CUDA_VISIBLE_DEVICES`` (an engine gets
``tensor_parallel_size`` consecutive GPUs of ``engine_gpus``; the trainer one rank per GPU of
``trainer_gpus``, under torchrun). In a cluster, where every pod gets GPUs of its own, the Helm
chart's ``placement.mode`` places pods on node pools instead and checks each pod's GPU limit
against what runs in it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DeviceMapConfig(BaseModel):
    """GPU placement of the mesh's engines and trainer on one machine."""

    model_config = ConfigDict(extra="forbid")

    placement: Literal["none", "disaggregated", "colocated"] = Field(
        "none",
        description="none: nothing pinned; disaggregated: engines and trainer on disjoint GPUs; colocated: "
        "on the same GPUs, the engines releasing their memory while the trainer trains.",
    )
    engine_gpus: list[int] = Field(
        default_factory=list,
        description="GPU indices of the engines, in engine order: run.num_engines x the "
        "engine's tensor_parallel_size of them, each engine taking the next consecutive ones.",
    )
    trainer_gpus: list[int] = Field(
        default_factory=list, description="GPU indices of the trainer, one rank per GPU (run.trainer_procs of them)."
    )

    @model_validator(mode="after")
    def _shape(self) -> DeviceMapConfig:
        if self.placement == "none":
            if self.engine_gpus or self.trainer_gpus:
                raise ValueError(
                    "devices.placement: 'none' pins nothing; set disaggregated or colocated to use "
                    "engine_gpus and trainer_gpus"
                )
            return self
        for name in ("engine_gpus", "trainer_gpus"):
            ids = getattr(self, name)
            if not ids:
                raise ValueError(f"devices.{name}: placement {self.placement!r} needs at least one GPU")
            if min(ids) < 0:
                raise ValueError(f"devices.{name}: GPU indices are >= 0, got {min(ids)}")
            if len(set(ids)) != len(ids):
                raise ValueError(f"devices.{name}: GPU {_first_repeat(ids)} is listed twice")
        shared = sorted(set(self.engine_gpus) & set(self.trainer_gpus))
        if self.placement == "disaggregated" and shared:
            raise ValueError(
                f"devices: disaggregated engines and trainer share GPU(s) {shared}; give them disjoint "
                "GPUs, or use placement: colocated"
            )
        if self.placement == "colocated" and set(self.engine_gpus) != set(self.trainer_gpus):
            raise ValueError(
                f"devices: colocated engines ({sorted(self.engine_gpus)}) and trainer "
                f"({sorted(self.trainer_gpus)}) must use the same GPUs"
            )
        return self


def _first_repeat(ids: list[int]) -> int:
    seen: set[int] = set()
    for i in ids:
        if i in seen:
            return i
        seen.add(i)
    raise ValueError("no repeat")


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA names them to a child: ``CUDA_VISIBLE_DEVICES``'s
    entries where it is set, else every GPU ``nvidia-smi`` lists (none without a driver)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


@dataclass
class Placement:
    """Each process's ``CUDA_VISIBLE_DEVICES`` (None: leave it alone) and the trainer's rank count."""

    engines: list[str | None]
    trainer: str | None
    trainer_procs: int


def check_shape(devices: DeviceMapConfig, num_engines: int, gpus_per_engine: int, trainer_procs: int) -> None:
    """Raise ``ValueError`` naming the field unless the map has the run's number of GPUs."""
    if devices.placement == "none":
        return
    need = num_engines * gpus_per_engine
    if len(devices.engine_gpus) != need:
        raise ValueError(
            f"devices.engine_gpus: {len(devices.engine_gpus)} GPU(s) for run.num_engines={num_engines} "
            f"engines of {gpus_per_engine} GPU(s) each (engine.tensor_parallel_size); {need} needed"
        )
    if trainer_procs != len(devices.trainer_gpus):
        raise ValueError(
            f"run.trainer_procs: {trainer_procs}, but devices.trainer_gpus lists "
            f"{len(devices.trainer_gpus)} GPU(s); the trainer runs one rank per GPU"
        )


def place(
    devices: DeviceMapConfig, num_engines: int, gpus_per_engine: int, trainer_procs: int, visible: list[str]
) -> Placement:
    """Check the map against the run's shape and the GPUs ``visible`` here (``visible_gpus``) and
    give each process its GPUs; raise ``ValueError`` naming the field."""
    check_shape(devices, num_engines, gpus_per_engine, trainer_procs)
    if devices.placement == "none":
        return Placement([None] * num_engines, None, trainer_procs)
    for name in ("engine_gpus", "trainer_gpus"):
        missing = [i for i in getattr(devices, name) if i >= len(visible)]
        if missing:
            seen = f"{len(visible)} visible ({', '.join(visible)})" if visible else "none visible"
            raise ValueError(
                f"devices.{name}: GPU {missing[0]} is not on this machine: {seen}"
                + (" (CUDA_VISIBLE_DEVICES)" if "CUDA_VISIBLE_DEVICES" in os.environ else "")
            )
    names = [visible[i] for i in devices.engine_gpus]
    engines = [",".join(names[e * gpus_per_engine : (e + 1) * gpus_per_engine]) for e in range(num_engines)]
    return Placement(engines, ",".join(visible[i] for i in devices.trainer_gpus), len(devices.trainer_gpus))


def gpus_per_engine(engine) -> int:
    """GPUs one engine of the ``engine:`` config takes (SGLang's tensor parallelism; 1 otherwise)."""
    return int(getattr(engine, "tensor_parallel_size", 1))
