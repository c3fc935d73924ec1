"""What the rollout loop needs from the rest of the mesh: four small ports and an observer.

``services/`` implements them over gRPC (the AsyncController, the LLMProxy, the SampleBuffer);
tests implement them in-process (the plain controller object, a scripted generate function, the
in-memory buffer) and run the loop without a socket. Errors cross a port as the project's own
exceptions, never as gRPC status codes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import numpy as np

from rollout.sampling import SamplingParams
from sample_buffer.buffer import PutResult
from sample_buffer.errors import TransientError
from sample_buffer.trajectory import FinishReason, Group, PutRefusal, Trajectory

__all__ = [
    "Admission",
    "Admitted",
    "Generate",
    "Generation",
    "Rewarder",
    "RolloutObserver",
    "SampleSink",
    "Teacher",
    "TeacherScores",
    "TransientError",
]


@dataclass(frozen=True)
class Admitted:
    """An answer of admission control: slots granted, at which policy version, under which bound."""

    num_groups: int
    version: int
    async_ratio: int


@dataclass
class Generation:
    """One generation's output, in the names it keeps all the way to the trainer's batch."""

    output_ids: list[int]
    behavior_logprobs: list[float]  # the engine's log-prob of each output token
    token_versions: list[int]  # the policy version that produced each output token
    finish_reason: FinishReason
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, when asked: (id, lp)
    # when asked (MoE routing replay): [positions, layers × top_k] expert ids of the context's forwarded
    # positions, prompt included (``sample_buffer/routing.py``); None: not asked or not sent
    routed_experts: np.ndarray | None = None


class GroupOutcome(StrEnum):
    PUT = "put"  # in the buffer: its slot counts as finished
    FILTERED = "filtered"  # the buffer kept it out (no learning signal): its slot goes back
    STALE = "stale"  # stopped as staler than the bound: never put, its slot goes back
    FAILED = "failed"  # an episode or the put raised: logged, counted, its slot goes back
    SURPLUS = "surplus"  # tail batching: it ended after its round's quota was in; never put
    EMPTY = "empty"  # an agent's group that ended with no trajectory (the gateway's): nothing to put

    @classmethod
    def of_put(cls, result: PutResult) -> GroupOutcome:
        """What a put's answer makes of a group: stored, filtered, or failed (the buffer stayed full)."""
        if result.accepted:
            return cls.PUT
        return cls.FILTERED if result.reason == PutRefusal.FILTERED else cls.FAILED


class Admission(Protocol):
    """The AsyncController as the rollout loop sees it."""

    async def admit(self, num_groups: int) -> Admitted:
        """Ask for up to ``num_groups`` slots under the staleness bound."""

    async def release(self, *, unused: int = 0, finished: int = 0) -> None:
        """Give slots back: ``unused`` (failed, filtered, stale, cancelled) or ``finished`` (in the buffer)."""

    def watch_versions(self) -> AsyncIterator[int]:
        """The policy version now and at every change."""


@dataclass
class TeacherScores:
    """A teacher's answer for tokens ``start``.. of a sequence: its log-prob of each, and with top-k
    each position's k most likely tokens and their log-probs ([n, k]; [n, 0] when none were asked)."""

    logprobs: list[float]
    top_ids: np.ndarray
    top_logprobs: np.ndarray


class Teacher(Protocol):
    """A teacher's LLMProxy (on-policy distillation, ``rollout/teachers.py``)."""

    async def score(
        self, token_ids: list[int], start: int, *, route: str, timeout_s: float, top_k: int = 0
    ) -> TeacherScores:
        """The log-prob the teacher gives each token of ``token_ids`` from ``start`` (>= 1) on, at
        temperature 1, and each position's ``top_k`` most likely tokens; ``route`` keeps a group's
        sequences on one engine. Raises ``TransientError`` when another try may succeed,
        ``TimeoutError`` past ``timeout_s``."""


class Generate(Protocol):
    """The LLMProxy as the rollout loop sees it."""

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        request_id: str,
        route: str,
        timeout_s: float,
        top_logprobs: int = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
        return_routed_experts: bool = False,
        images: tuple[bytes, ...] = (),
    ) -> Generation:
        """Generate for ``input_ids``; ``route`` keeps requests that share it on one engine.
        ``top_logprobs``: also the most likely tokens at each position; ``on_tokens``: stream the
        generation, handing new tokens over as they are made (the agent gateway's streams; the
        rollout loop passes neither); ``return_routed_experts``: an MoE model's experts per
        position; ``images``: a vision-language prompt's encoded images, one placeholder token for
        each in ``input_ids``. Raises ``TransientError`` when the call may succeed if tried again."""

    async def abort(self, request_id: str) -> None:
        """Stop a running generation; it returns its partial output as ``abort``."""

    # A Generate may also take a group's samples in one call (the LLMProxy's GenerateGroup); the loop
    # uses it where it exists (``RolloutConfig.replicate_prompts`` false), one call a member otherwise:
    #   async def generate_group(input_ids, sampling, *, request_ids, route, timeout_s) -> list[Generation]
    # Each sample is in flight under its own request id (``abort`` takes it).


class SampleSink(Protocol):
    """The SampleBuffer as the rollout loop sees it."""

    async def put(self, group: Group) -> PutResult:
        """Store a finished group; the result says whether the buffer kept it (or filtered it). How long
        it may wait on a full buffer is the buffer's ``put_timeout_s``, not the caller's."""


class Rewarder(Protocol):
    """A reward as an environment calls it when an episode ends: a function of rollout/rewards.py,
    reward workers (``RewardPool``), the code sandbox, the judge, or the reward service's client.
    Thread-safe (environments step in threads). The pooled ones are bounded in time: a verifier
    that fails or hangs there scores 0 and counts the fault in ``failures`` (by cause)."""

    def __call__(self, response: str, answer: str) -> float: ...


class RolloutObserver:
    """Where the loop reports what happened (the EnvManager's Prometheus metrics). Every hook
    is a no-op here, so a test passes the base class and a service overrides what it records."""

    def turn(self, env: str, generate_s: float, step_s: float | None) -> None:
        """One turn of an episode: its generation's and environment step's seconds (None: no step)."""

    def episode_ended(self, trajectory: Trajectory, seconds: float, domain: str = "") -> None:
        """An episode of ``domain`` ended (reset to its last step)."""

    def member_dropped(self, cause: str, tokens: int = 0) -> None:
        """A member left out of its group: a fault (``RolloutConfig.faulty_members``: timeout,
        env_error, raised) or cancelled once its group was full (``redundant``), after it had
        generated ``tokens``."""

    def group_ended(
        self, outcome: GroupOutcome, trajectories: list[Trajectory], seconds: float, domain: str = ""
    ) -> None:
        """A group of ``domain`` ended: ``put``, ``filtered``, ``stale`` or ``failed`` (then ``trajectories``
        is empty)."""

    def generate_retried(self, code: str) -> None:
        """A generation was retried after a ``TransientError`` with this code."""
