"""A group's teacher call (on-policy distillation): the moment its last member ends, the teacher
scores every member's tokens and each trajectory carries the log-probs of its generated ones.

The teacher is another model behind its own LLMProxy (the ``Teacher`` port); it sees the student's
tokens as they are, so it must share the student's tokenizer (checked when the run loads). A
member's tokens from its first generated one on go in one call (a multi-turn episode's environment
tokens between its turns are context the teacher reads, never scored). A teacher that is down
(unavailable: restarting) is asked again until the deadline; one that refuses, fails, stays down
past the deadline or answers other than one log-prob per token fails the group (``TeacherFailed``),
which the loop counts and never puts: a group is trained on whole, its members taught alike.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import numpy as np

from rollout.ports import Teacher, TeacherScores
from sample_buffer.deadlines import wait_for
from sample_buffer.errors import TransientError, raise_if_cancelled
from sample_buffer.trajectory import Trajectory

# A teacher that is down (its proxy or engine restarting) is asked again after these pauses, doubling.
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 2.0


class TeacherFailed(RuntimeError):
    """The teacher did not score a group's tokens in time or in full; the message says which and why."""


def first_generated(loss_mask: np.ndarray) -> int:
    """The position of a trajectory's first generated token (-1: none)."""
    hits = np.flatnonzero(loss_mask)
    return int(hits[0]) if len(hits) else -1


def generated_logprobs(loss_mask: np.ndarray, start: int, scored: list[float]) -> np.ndarray:
    """The scores of positions ``start``.. kept where the policy generated the token ([G] float32)."""
    if len(scored) != len(loss_mask) - start:
        raise TeacherFailed(f"{len(scored)} log-probs for the {len(loss_mask) - start} tokens asked")
    return np.asarray(scored, dtype=np.float32)[loss_mask[start:] > 0]


def taught(t: Trajectory, start: int, scores: TeacherScores, top_k: int) -> Trajectory:
    """``t`` with the teacher's answer for its positions ``start``.., kept at its generated tokens."""
    lps = generated_logprobs(t.loss_mask, start, scores.logprobs)
    if not top_k:
        return replace(t, teacher_logprobs=lps)
    if scores.top_ids.shape != (len(scores.logprobs), top_k):
        raise TeacherFailed(f"top-k of shape {scores.top_ids.shape} for {len(scores.logprobs)} tokens of {top_k}")
    kept = t.loss_mask[start:] > 0
    return replace(
        t, teacher_logprobs=lps, teacher_top_ids=scores.top_ids[kept], teacher_top_logprobs=scores.top_logprobs[kept]
    )


async def teach(
    teacher: Teacher, trajectories: list[Trajectory], route: str, timeout_s: float, top_k: int = 0
) -> list[Trajectory]:
    """``trajectories`` with their teacher's log-probs (and with ``top_k`` each generated position's
    most likely tokens), every member scored at once within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s

    async def one(t: Trajectory) -> Trajectory:
        start = first_generated(t.loss_mask)
        if start < 0:  # nothing generated: nothing to score
            none = np.zeros((0, top_k), dtype=np.float32)
            top = {"teacher_top_ids": none.astype(np.int32), "teacher_top_logprobs": none} if top_k else {}
            return replace(t, teacher_logprobs=np.zeros(0, dtype=np.float32), **top)
        if start == 0:
            raise TeacherFailed(f"{t.trajectory_id}: its first token is generated, with no context to score it in")
        pause = RETRY_FIRST_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TeacherFailed(f"no answer within {timeout_s:g} s")
            try:
                scored = await wait_for(
                    teacher.score(t.token_ids.tolist(), start, route=route, timeout_s=left, top_k=top_k), left
                )
                return taught(t, start, scored, top_k)
            except TimeoutError:
                raise TeacherFailed(f"no answer within {timeout_s:g} s") from None
            except TransientError as e:  # its proxy or engine restarting: again, within the deadline
                raise_if_cancelled()  # a cancel of ours that came back as the call's error
                if deadline - time.monotonic() <= pause:
                    raise TeacherFailed(f"{type(e).__name__} until the deadline: {e}") from None
                await asyncio.sleep(pause)
                pause = min(2 * pause, RETRY_MAX_S)
            except (ValueError, RuntimeError, ConnectionError) as e:  # refusals, a failed engine
                raise TeacherFailed(f"{type(e).__name__}: {e}") from None

    # Every call to its end (each within the deadline), so none is left running when one fails.
    results = await asyncio.gather(*(one(t) for t in trajectories), return_exceptions=True)
    if failed := next((r for r in results if isinstance(r, BaseException)), None):
        raise failed
    return results
