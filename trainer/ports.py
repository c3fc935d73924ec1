"""What the training loop needs from the rest of the mesh: three small ports (a fourth for
colocated engines) and an observer.

``services/trainer`` implements them over gRPC (the SampleBuffer, the AsyncController, the
LLMProxy); tests implement them in-process (the in-memory buffer, the plain controller object)
and run the loop without a socket.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from sample_buffer.buffer import Batch
from sample_buffer.errors import TransientError

__all__ = [
    "EngineMemory",
    "Limits",
    "PublishError",
    "SampleSource",
    "TrainObserver",
    "TransientError",
    "VersionControl",
    "WeightPublisher",
]


class SampleSource(Protocol):
    """The SampleBuffer as the trainer sees it."""

    async def get(self, num_groups: int, version: int, max_staleness: int, timeout_s: float) -> Batch:
        """Up to ``num_groups`` groups no older than ``version - max_staleness``."""

    async def ack(self, batch_id: str) -> int:
        """The batch was trained on: it is never handed out again."""

    async def requeue(self) -> int:
        """Every batch handed out and not acked goes back to the queue now (its consumer is gone)."""


class Limits(NamedTuple):
    """What the controller admits under, and the version it is at."""

    async_ratio: int
    groups_per_step: int
    version: int


class VersionControl(Protocol):
    """The AsyncController as the trainer sees it: slots, bounds and the weight-update protocol."""

    async def limits(self) -> Limits:
        """The bound the controller admits under and its current version."""

    async def release(self, *, dropped: int) -> None:
        """Finished groups the buffer dropped as too stale: their slots go back to admission."""

    async def begin_update(self, new_version: int, timeout_s: float, supersede: bool = False) -> str:
        """Suspend generation for an update to ``new_version``; returns the update's id.
        ``supersede``: roll back an update still in progress first (a dead predecessor's)."""

    async def commit_update(self, update_id: str, version: int, model_path: str) -> int:
        """Make ``version`` current (``model_path``: where it can be restored from) and resume."""

    async def abort_update(self, update_id: str, reason: str) -> int:
        """Roll every engine back to the current version and resume."""


class WeightPublisher(Protocol):
    """A weight transport: how a new version gets from the trainer onto every engine.

    ``export`` runs on every rank (gathering sharded weights is collective) before generation is
    suspended; ``load`` runs on rank 0 between suspend and resume and raises on any engine's
    failure (the loop then rolls back); ``committed`` runs once the version is current. A
    publisher may keep ``stats`` (name -> number) of its last ``load``: they join the step's metrics.
    """

    def export(self, engine, version: int) -> str:
        """Make ``version``'s weights ready to send; returns where it can be restored from."""

    async def load(self, version: int, timeout_s: float) -> None:
        """Move every engine to ``version``; raises ``PublishError`` naming what failed."""

    def committed(self, version: int) -> None:
        """``version`` is current: older copies may go."""


class EngineMemory(Protocol):
    """Colocated engines (they share the trainer's GPUs): they give their GPU memory back while the
    trainer trains, and take it again before the new weights load."""

    async def release(self) -> None:
        """Suspend generation and free the engines' GPU memory; raises on any engine's failure."""

    async def restore(self) -> None:
        """The engines take their memory back and generate again (with the weights they had, until
        the update that follows)."""


class PublishError(RuntimeError):
    """A weight transport could not move every engine to the new version."""


class TrainObserver:
    """Where the loop reports (metrics.jsonl, Prometheus, trackers). No-ops here."""

    def step_done(self, metrics: dict, staleness: list[int]) -> None:
        """A step's metrics (rank 0) and the staleness of every trajectory it trained on."""

    def checkpoint_done(self, seconds: float) -> None:
        """A checkpoint was written (rank 0), after its step's ``step_done``."""

    def update_done(self, seconds: float, location: str) -> None:
        """A weight update was committed; ``location`` is what ``export`` returned."""

    def update_failed(self, cause: str) -> None:
        """A weight update failed at ``cause``: export, begin, load or commit."""
